"""The run directory (``--save``): every path a run writes, and what may be pruned when. One owner, so the layout
is written once and each deletion says why it is safe.

```
<root>/hf/stage_k/          θ_k as an HF folder, the engine's weights for stage k (pruned once D_k is durable)
<root>/hf/iter_N/           --hf-export-interval exports (for tools/evaluate.py --run); hf/final/ at the end
<root>/hf/sync_V/           async mode: the weights of version V the engine process loads (pruned once it moved on)
<root>/rollouts/stage_k/    the static dataset D_k: Parquet shards + manifest.json
<root>/rollouts/async/      async mode's durable queue
<root>/iter_NNNNNNN/        training checkpoints (megamu.training.checkpoint; retention: --keep-checkpoints)
<root>/offload/             the trainer's spilled state during a CPU rollout
<root>/data/                prompt splits
<root>/metrics.jsonl        one record per update / stage / evaluation / sync / run; <root>/tensorboard/ mirrors it
```
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from megamu.rollout.dataset import MANIFEST  # written last by the rollout phase: D_k is durable once it exists
from megamu.runtime.atomic import remove_dir


@dataclass(frozen=True)
class RunDir:
    root: Path

    def __post_init__(self):
        object.__setattr__(self, "root", Path(self.root))

    # -- weights for engines and evaluation
    @property
    def exports(self) -> Path:
        return self.root / "hf"

    def export(self, name: str) -> Path:
        return self.exports / name

    def stage_export(self, stage: int) -> Path:
        return self.export(f"stage_{stage}")

    def iter_export(self, update: int) -> Path:
        return self.export(f"iter_{update:07d}")

    def sync_export(self, version: int) -> Path:
        return self.export(f"sync_{version:07d}")

    @property
    def final_export(self) -> Path:
        return self.export("final")

    # -- data and state
    def stage_rollouts(self, stage: int) -> Path:
        return self.root / "rollouts" / f"stage_{stage}"

    def stage_done(self, stage: int) -> bool:
        """Whether D_k is durable (its manifest, written last, exists)."""
        return (self.stage_rollouts(stage) / MANIFEST).exists()

    @property
    def async_queue(self) -> Path:
        return self.root / "rollouts" / "async"

    @property
    def offload(self) -> Path:
        return self.root / "offload"

    @property
    def data(self) -> Path:
        return self.root / "data"

    @property
    def tensorboard(self) -> Path:
        return self.root / "tensorboard"

    # -- pruning
    def prune_stage_export(self, stage: int) -> bool:
        """Delete ``hf/stage_k`` once D_k is durable: the stage's data no longer needs it, and a resume skips that
        rollout. ``hf/final`` and the ``iter_N`` folders are never touched. Returns whether a folder was deleted."""
        folder = self.stage_export(stage)
        if not self.stage_done(stage) or not folder.is_dir():
            return False
        remove_dir(folder)
        for leftover in folder.parent.glob(f".{folder.name}.deleting-*"):  # a delete a killed run left half done
            shutil.rmtree(leftover)
        return True

    def prune_done_stage_exports(self) -> list[int]:
        """At a run's start, before any engine loads one: delete every ``hf/stage_k`` whose D_k is durable. A killed
        run leaves one behind (the folder its colocated servers were launched from, kept for their restarts, or a
        kill between D_k's manifest and the prune), and a resume skips that stage's rollout. Returns the stages."""
        stages = sorted(int(d.name[6:]) for d in self.exports.glob("stage_*") if d.name[6:].isdigit())
        return [k for k in stages if self.prune_stage_export(k)]

    def prune_iter_exports(self, keep: int) -> list[Path]:
        """Keep the newest ``keep`` ``hf/iter_N`` exports (--hf-export-interval; 0: all): a 7B export is ~15 GB, and
        one every 200 updates of a 4096-update run would otherwise fill ~300 GB. Returns the deleted folders."""
        found = sorted((d for d in self.exports.glob("iter_*") if d.name[5:].isdigit()), key=lambda d: int(d.name[5:]))
        doomed = found[:-keep] if keep > 0 else []
        for folder in doomed:
            remove_dir(folder)
        return doomed

    def sync_exports(self) -> dict[int, Path]:
        return {int(d.name.removeprefix("sync_")): d for d in self.exports.glob("sync_*")}

    def prune_sync_exports(self, below: int | None = None, keep: Path | None = None) -> None:
        """Delete async sync folders of versions below ``below`` (the engine process never goes back to them; None:
        all, for a resumed run whose later folders came from a lost timeline), except ``keep``."""
        for version, folder in self.sync_exports().items():
            if folder != keep and (below is None or version < below):
                shutil.rmtree(folder, ignore_errors=True)
