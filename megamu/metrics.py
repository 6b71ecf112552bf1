"""Run metrics: one JSON object per line in <save>/metrics.jsonl, mirrored to tensorboard. Rank 0 writes."""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path


class MetricsLogger:
    """Appends records of kind "update", "stage", "eval" and "run"; every record carries ``time`` since the run began.

    On resume, records past the point the run resumes from are dropped first, so a resumed run's file reads as if it
    had never stopped (the replayed updates are logged again, once).
    """

    def __init__(self, save_dir: str, tensorboard_dir: str | None, *, enabled: bool, elapsed_offset: float = 0.0):
        self.enabled = enabled
        self.path = Path(save_dir) / "metrics.jsonl"
        self.t0 = time.time() - elapsed_offset
        self.writer = None
        if enabled and tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(tensorboard_dir)

    def elapsed(self) -> float:
        return time.time() - self.t0

    def truncate(self, *, stage: int, update: int) -> None:
        """Keep only what happened before (stage, update): updates < update, stages < stage, evals of earlier stages."""
        if not self.enabled or not self.path.exists():
            return
        kept = []
        for line in self.path.read_text().splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line torn by a kill mid-write
            kind = rec.get("kind")
            if (kind == "update" and rec["update"] < update) or (kind in ("stage", "eval") and rec["stage"] < stage):
                kept.append(line)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text("".join(k + "\n" for k in kept))
        os.replace(tmp, self.path)

    def log(self, kind: str, step: int | None = None, **fields) -> dict:
        rec = {"kind": kind, **clean(fields), "time": round(self.elapsed(), 3)}
        if not self.enabled:
            return rec
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a") as f:
            f.write(json.dumps(rec, allow_nan=False) + "\n")
        if self.writer is not None and step is not None:
            for key, value in fields.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
                    self.writer.add_scalar(f"{kind}/{key}", value, step)
            self.writer.flush()
        return rec

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def clean(stats: dict) -> dict:
    """NaN/inf -> None so records stay valid JSON (e.g. E[ρ | A<0] of a batch without negative advantages)."""
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in stats.items()}
