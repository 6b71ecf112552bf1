"""A training run on disk, as evaluation and plotting see it: its metrics log and its HF checkpoints.

Layout (written by ``pretrain_mu_grpo.py``): ``<save>/metrics.jsonl`` and HF folders ``<save>/hf/stage_k`` (the
policy frozen at the start of stage k, so stage_0 is the initial model), ``<save>/hf/final`` (after the last update)
and optionally ``<save>/hf/iter_N`` (after N updates). A checkpoint's wall-clock time is taken from the metrics of
the updates behind it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from megamu.observability.metrics import read_metrics
from megamu.run.run_dir import RunDir


@dataclass(frozen=True)
class Checkpoint:
    name: str
    hf_dir: Path
    updates: int | None  # policy updates behind this checkpoint; None when unknown
    time: float | None  # run seconds at which this policy existed; None without metrics


def update_records(metrics: list[dict]) -> list[dict]:
    """Update records, one per update index (a resumed run re-logs the updates it redoes: the last one wins)."""
    by_update = {r["update"]: r for r in metrics if r.get("kind") == "update" and "update" in r}
    return [by_update[u] for u in sorted(by_update)]


def _updates_and_time(name: str, updates: list[dict]) -> tuple[int | None, float | None]:
    """Updates behind a checkpoint and the run time it existed at. Update indices are 0-based and ``--log-interval``
    may skip some, but the last update of every stage is always logged."""
    if not updates:
        return None, None
    m = re.fullmatch(r"stage_(\d+)", name)
    if m:
        before = [r for r in updates if r.get("stage", 0) < int(m.group(1))]
        return (before[-1]["update"] + 1, before[-1].get("time")) if before else (0, 0.0)
    if name == "final":  # exported by the loop after the last update
        return updates[-1]["update"] + 1, updates[-1].get("time")
    m = re.fullmatch(r"iter_(\d+)", name)
    if m:
        n = int(m.group(1))
        logged = [r for r in updates if r["update"] < n]
        return n, (logged[-1].get("time") if logged else 0.0)
    return None, None


def run_checkpoints(run_dir: str | Path) -> list[Checkpoint]:
    """HF folders under ``<run>/hf`` (those with a config.json), ordered by the updates behind them."""
    run = Path(run_dir)
    hf_root = RunDir(run).exports
    if not hf_root.is_dir():
        raise FileNotFoundError(f"{hf_root}: no HF exports in this run (expected {hf_root}/stage_k folders)")
    updates = update_records(read_metrics(run))
    ckpts = []
    for d in sorted(p for p in hf_root.iterdir() if (p / "config.json").is_file()):
        n, t = _updates_and_time(d.name, updates)
        ckpts.append(Checkpoint(d.name, d, n, t))
    if not ckpts:
        raise FileNotFoundError(f"{hf_root}: no HF checkpoint folder (with config.json) inside")

    def order(c: Checkpoint):
        m = re.search(r"(\d+)$", c.name)
        return (c.updates if c.updates is not None else float("inf"), int(m.group(1)) if m else 0, c.name)

    return sorted(ckpts, key=order)
