"""The run's final table, read back from its metrics: per-stage rollout reward and timings, async mode's queue
numbers, then the evaluations."""

from __future__ import annotations

from pathlib import Path

from megamu.observability.metrics import read_metrics


def print_summary(save: Path, metrics_path: str) -> None:
    rows = read_metrics(save)
    print("\n stage | rollout reward | all-correct | all-wrong | trunc. | t_export | t_rollout | t_train")
    for r in (r for r in rows if r["kind"] == "stage"):
        print(f" {r['stage']:>5} | {r['reward_mean']:>14.3f} | {r['all_correct_fraction']:>11.2f} | "
              f"{r['all_wrong_fraction']:>9.2f} | {r['truncation_rate']:>6.2f} | {r['t_export']:>7.1f}s |"
              f" {r['t_rollout']:>8.1f}s | {r['t_train']:>6.1f}s")
    last = [r for r in rows if r["kind"] == "update" and "idle_ratio" in r][-1:]
    for r in last:  # async mode's updates carry the queue's numbers
        print(f" async: trainer idle ratio {r['idle_ratio']:.3f}, {r['dropped_stale']} stale samples dropped, "
              f"{sum(x['kind'] == 'sync' for x in rows)} weight syncs")
    for r in (r for r in rows if r["kind"] == "eval"):
        sampled = f", pass@1 {r['pass1']:.3f} (k = {r['k']})" if "pass1" in r else ""
        print(f" {r.get('set', 'held-out')} greedy accuracy ({r['label']}): {r['accuracy']:.3f}{sampled} on "
              f"{r['n']} prompts")
    for r in [r for r in rows if r["kind"] == "run"][-1:]:
        print(f" total {r['t_total']:.1f}s, {r['total_updates']} updates; metrics in {metrics_path}")
