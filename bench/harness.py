"""What the bench scripts share: running the trainer, interleaving the cases they compare, and one report format.

A benchmark here compares cases side by side in one process tree (A, B, A, B, ...), so that the drift of a shared
machine's speed (up to 1.4x hour to hour on these VMs) hits every case alike, and prints a table plus one JSON line.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


@dataclass
class TrainerRun:
    rows: list[dict]  # the run's metrics records
    wall_s: float
    output: str  # stdout + stderr


def run_trainer(flags: list[str], save: Path, *, log: Path | None = None, env: dict | None = None) -> TrainerRun:
    """``pretrain_mu_grpo.py FLAGS --save SAVE`` to completion in a session of its own (an interrupted bench kills the
    whole tree, torchrun's ranks included); its output goes to ``log`` when given. A failed run is a SystemExit that
    quotes the output's tail."""
    from megamu.observability.metrics import read_metrics

    cmd = [sys.executable, str(REPO / "pretrain_mu_grpo.py"), *flags, "--save", str(save)]
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_WAIT_POLICY="PASSIVE", **(env or {}))
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        output, _ = proc.communicate()
    except BaseException:
        os.killpg(proc.pid, 9)
        proc.communicate()
        raise
    wall = time.perf_counter() - t0
    if log is not None:
        log.write_text(output)
    if proc.returncode != 0:
        raise SystemExit(f"pretrain_mu_grpo.py {' '.join(flags)} failed ({proc.returncode}); output tail:\n"
                         f"{output[-3000:]}")
    return TrainerRun(read_metrics(save), wall, output)


def interleave(cases: dict[str, Callable[[], dict]], rounds: int, warmup: int = 0) -> dict[str, list[dict]]:
    """Each case's results over ``rounds`` rounds, the cases alternating within each round; ``warmup`` rounds first,
    whose results are dropped (allocators, caches)."""
    results: dict[str, list[dict]] = {name: [] for name in cases}
    for r in range(warmup + rounds):
        for name, run in cases.items():
            out = run()
            if r >= warmup:
                results[name].append(out)
    return results


def timed(fn: Callable[[], object]) -> dict:
    """Run ``fn``: its wall and CPU seconds (CPU seconds are what other tenants of the machine disturb least)."""
    t0, c0 = time.perf_counter(), time.process_time()
    value = fn()
    return {"wall_s": time.perf_counter() - t0, "cpu_s": time.process_time() - c0, "value": value}


def median(results: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in results)


def report(title: str, rows: list[dict], baseline: str | None = None, ratio_of: str | None = None) -> None:
    """A table of ``rows`` (dicts with the same keys, the first being the case's name), with each row's ``ratio_of``
    over the ``baseline`` row's when both are given; then one ``json:`` line holding every row."""
    if baseline is not None and ratio_of is not None:
        base = next(r[ratio_of] for r in rows if next(iter(r.values())) == baseline)
        rows = [{**r, f"{ratio_of} vs {baseline}": round(r[ratio_of] / base, 3)} for r in rows]
    keys = list(rows[0])
    cells = [[_cell(r.get(k)) for k in keys] for r in rows]
    widths = [max(len(k), *(len(c[i]) for c in cells)) for i, k in enumerate(keys)]
    print(f"\n== {title}")
    print(" | ".join(k.ljust(w) for k, w in zip(keys, widths)))
    print("-+-".join("-" * w for w in widths))
    for c in cells:
        print(" | ".join(v.ljust(w) for v, w in zip(c, widths)))
    print("json: " + json.dumps({"title": title, "rows": rows}))


def _cell(v) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def tiny_llama(folder: Path, hidden: int = 128) -> Path:
    """A random 4-layer llama of width ``hidden`` with the char tokenizer (score it with a digit reward: it earns no
    math reward)."""
    from tests.tiny import save_tiny_model

    return save_tiny_model(folder, "llama", hidden_size=hidden, intermediate_size=hidden * 3, num_hidden_layers=4,
                           num_attention_heads=8, num_key_value_heads=4)
