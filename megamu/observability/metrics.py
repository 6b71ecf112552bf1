"""Run metrics: one JSON object per line in <save>/metrics.jsonl, mirrored to tensorboard. Rank 0 writes."""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

from megamu.runtime.atomic import atomic_write_text


class MetricsLogger:
    """Appends records of kind "update", "stage", "eval", "sync" (weight pushes: per refresh, or async mode's per
    interval) and "run"; every record carries ``time`` since the run began.

    On resume, records past the point the run resumes from are dropped first, so a resumed run's file reads as if it
    had never stopped (the replayed updates are logged again, once).
    """

    def __init__(self, save_dir: str, tensorboard_dir: str | None, *, enabled: bool, elapsed_offset: float = 0.0,
                 tracker=None):
        self.enabled = enabled
        self.path = Path(save_dir) / "metrics.jsonl"
        self.t0 = time.time() - elapsed_offset
        self.writer = None
        self.tracker = tracker if enabled else None  # megamu.observability.tracking: wandb, when asked for
        if enabled and tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(tensorboard_dir)

    def elapsed(self) -> float:
        return time.time() - self.t0

    def truncate(self, *, stage: int, update: int) -> None:
        """Keep only what happened before (stage, update): updates < update, stages < stage, evals of policies
        before update (older records without ``update``: of earlier stages),
        syncs of earlier stages (a refresh's, logged with its stage) or after updates <= update (async mode's: the
        sync after update N is logged as update N)."""
        if not self.enabled or not self.path.exists():
            return
        kept = [
            rec for rec in read_metrics(self.path.parent)
            if (rec.get("kind") == "update" and rec["update"] < update)
            or (rec.get("kind") == "stage" and rec["stage"] < stage)
            # evaluations of policies before the checkpoint's (a stage's starts after its first rollout)
            or (rec.get("kind") == "eval" and (rec["update"] < update if "update" in rec else rec["stage"] < stage))
            or (rec.get("kind") == "sync" and (rec["stage"] < stage if "stage" in rec else rec["update"] <= update))
        ]
        atomic_write_text(self.path, "".join(json.dumps(rec) + "\n" for rec in kept))

    def log(self, kind: str, step: int | None = None, *, tag: str | None = None, **fields) -> dict:
        """One record; with ``step``, its numbers also go to tensorboard and the tracker as ``<tag>/<field>`` (``tag``
        defaults to ``kind``; evaluations tag each set apart)."""
        rec = {"kind": kind, **clean(fields), "time": round(self.elapsed(), 3)}
        if not self.enabled:
            return rec
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a") as f:
            f.write(json.dumps(rec, allow_nan=False) + "\n")
        if step is None:
            return rec
        if self.writer is not None:
            for key, value in fields.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
                    self.writer.add_scalar(f"{tag or kind}/{key}", value, step)
            self.writer.flush()
        if self.tracker is not None:
            self.tracker.log(tag or kind, step, fields)
        return rec

    def table(self, name: str, columns: list[str], rows: list[list]) -> None:
        """A table of rows (sample generations) for the tracker; tensorboard and metrics.jsonl keep numbers only."""
        if self.tracker is not None:
            self.tracker.table(name, columns, rows)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        if self.tracker is not None:
            self.tracker.close()


def clean(stats: dict) -> dict:
    """NaN/inf -> None so records stay valid JSON (e.g. E[ρ | A<0] of a batch without negative advantages)."""
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in stats.items()}


def read_metrics(run_dir: str | Path) -> list[dict]:
    """All records of ``<run>/metrics.jsonl`` in file order. A line cut short by a kill is skipped with a warning."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        return []
    rows = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                print(f"warning: {path}:{lineno}: not valid JSON (a line cut by a kill?), skipped", file=sys.stderr)
    return rows
