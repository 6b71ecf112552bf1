"""Experiment tracking beside tensorboard: Weights & Biases (slime's and verl's choice), rank 0 only.

Every metrics record goes to wandb as ``<kind>/<field>`` against its own x-axis (``<kind>/step``: the update for
update records, the stage for stage records), so stage and update records never fight over wandb's one step counter.
Each stage also logs a table of sample generations (verl's ``generations`` table). The wandb run id is kept in the
run directory, so a resumed run continues the same wandb run. ``mode="offline"`` writes under ``dir`` with no network
(``wandb sync`` uploads it later).
"""

from __future__ import annotations

import math
import uuid
from dataclasses import dataclass
from pathlib import Path

from megamu.config_fields import flag
from megamu.errors import check_choice

WANDB_MODES = ("online", "offline")


@dataclass(frozen=True)
class TrackerConfig:
    wandb: bool = flag("--use-wandb", default=False, action="store_true", help=(
        "log every record and a table of each stage's sample generations to Weights & Biases (pip install wandb); "
        "a resumed run continues the same wandb run"))
    project: str = flag("--wandb-project", default="megamu")
    group: str | None = flag("--wandb-group", default=None)
    name: str | None = flag("--wandb-name", default=None, help="default: the --save folder's name")
    mode: str = flag("--wandb-mode", default="online", choices=WANDB_MODES, help=(
        "offline: write under --wandb-dir without a network (`wandb sync` uploads it later)"))
    # default: the run directory (wandb makes wandb/ inside)
    dir: Path | None = flag("--wandb-dir", default=None, type=Path, help="default: --save")
    table_rows: int = 16  # sample generations logged per stage

    def __post_init__(self):
        check_choice(self, "mode", WANDB_MODES)


class WandbTracker:
    def __init__(self, cfg: TrackerConfig, save_dir: Path, config: dict):
        import wandb

        save_dir.mkdir(parents=True, exist_ok=True)
        id_file = save_dir / "wandb_run_id"  # the same wandb run across restarts of this run
        run_id = id_file.read_text().strip() if id_file.exists() else uuid.uuid4().hex[:12]
        id_file.write_text(run_id + "\n")
        self.run = wandb.init(project=cfg.project, group=cfg.group, name=cfg.name or save_dir.resolve().name,
                              id=run_id, resume="allow", mode=cfg.mode, dir=str(cfg.dir or save_dir), config=config,
                              settings=wandb.Settings(silent=True))
        self.wandb, self.kinds, self.table_rows = wandb, set(), cfg.table_rows

    def log(self, kind: str, step: int, fields: dict) -> None:
        if kind not in self.kinds:
            self.kinds.add(kind)
            self.run.define_metric(f"{kind}/*", step_metric=f"{kind}/step")
        data = {f"{kind}/{k}": v for k, v in fields.items()
                if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}
        self.run.log({f"{kind}/step": step, **data})

    def table(self, name: str, columns: list[str], rows: list[list]) -> None:
        self.run.log({name: self.wandb.Table(columns=columns, data=rows[: self.table_rows])})

    def close(self) -> None:
        self.run.finish()


def make_tracker(cfg: TrackerConfig | None, save_dir: Path, config: dict) -> WandbTracker | None:
    return WandbTracker(cfg, save_dir, config) if cfg is not None and cfg.wandb else None
