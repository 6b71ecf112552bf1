"""Async μ-GRPO (§5.1, Table 2) vs staged μ-GRPO (§4), side by side in one run on the same CPU setup.

Same updates, same B_mini x G samples per update, same algorithm. Staged: S stages of μ = U/S updates. Async: U
updates with weights pushed every N updates and the lag capped at K = μ (the staged run's staleness). Prints
wall-clock, the trainer's idle ratio (staged: export + rollout time over the trainer's time; async: time waiting for
samples over everything else), mean policy lag (staged: update index within its stage) and final held-out accuracy.

On a shared CPU the engine process and the trainer compete for the same cores, so async cannot show the paper's
speed-up here: overlap only pays when rollout and training have devices of their own.

    python -m bench.async_vs_staged [--updates 16] [--stages 2] [--sync-interval 2] [--model tiny|smollm2]
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

from bench.harness import report
from bench.staged_vs_standard import bench_model, trainer_rows


def final_accuracy(rows: list[dict]) -> float:
    return next((r["accuracy"] for r in rows if r["kind"] == "eval" and r["label"] == "final"), float("nan"))


def staged_summary(rows: list[dict], mu: int) -> dict:
    stages = [r for r in rows if r["kind"] == "stage"]
    waiting = sum(s["t_rollout"] + s["t_export"] for s in stages)
    updates = [r for r in rows if r["kind"] == "update"]
    return {"case": "staged", "t_total": next(r["t_total"] for r in rows if r["kind"] == "run"),
            "idle_ratio": waiting / max(waiting + sum(s["t_train"] for s in stages), 1e-9),
            "mean_lag": sum(u["update"] % mu for u in updates) / len(updates),
            "dropped_stale": 0, "final_accuracy": final_accuracy(rows)}


def async_summary(rows: list[dict]) -> dict:
    updates = [r for r in rows if r["kind"] == "update"]
    return {"case": "async", "t_total": next(r["t_total"] for r in rows if r["kind"] == "run"),
            "idle_ratio": updates[-1]["idle_ratio"],
            "mean_lag": sum(u["policy_lag_mean"] for u in updates) / len(updates),
            "dropped_stale": updates[-1]["dropped_stale"], "final_accuracy": final_accuracy(rows)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--updates", type=int, default=16)
    p.add_argument("--stages", type=int, default=2)
    p.add_argument("--sync-interval", type=int, default=2)
    p.add_argument("--prompts-per-update", type=int, default=2)
    p.add_argument("--eval-prompts", type=int, default=20)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--model", choices=["tiny", "smollm2"], default="tiny", help="smollm2: the demo model and task")
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = bench_model(Path(tmp), a.model, a.hidden)
        b, mu = a.prompts_per_update, a.updates // a.stages
        staged = staged_summary(trainer_rows(model, Path(tmp) / "staged", [
            "--algorithm", "mu-grpo", "--num-stages", str(a.stages), "--prompts-per-stage", str(mu * b),
            "--prompts-per-update", str(b)],
            a.eval_prompts), mu)
        asyn = async_summary(trainer_rows(model, Path(tmp) / "async", [
            "--algorithm", "mu-grpo", "--rollout-mode", "async", "--train-iters", str(a.updates),
            "--prompts-per-update", str(b),
            "--weight-sync-interval", str(a.sync_interval), "--max-policy-lag", str(max(mu, a.sync_interval)),
            "--rollout-groups-per-shard", str(b)],  # one update per engine call
            a.eval_prompts))
    report(f"model {a.model}, {a.updates} updates x {b} groups x 8 samples; staged: {a.stages} stages of μ = {mu}; "
           f"async: sync every {a.sync_interval}, K = {max(mu, a.sync_interval)}; {os.cpu_count()} CPUs",
           [staged, asyn], baseline="staged", ratio_of="t_total")

if __name__ == "__main__":
    main()
