"""How much each algorithm preset learns: held-out greedy accuracy before and after, on the demo task, side by side.

Runs ``pretrain_mu_grpo.py`` once per preset with the same data, seed, budget and held-out prompts (the demo's
SmolLM2-135M-Instruct and two-digit addition unless --hf-checkpoint / --prompt-data say otherwise) and prints, per run:
μ, stages, updates, rollout samples, wall-clock, the rollout reward of each stage and the held-out greedy accuracy of
the base and of the final policy. The default budget is short (a smoke check of a few minutes per preset on 2 cores);
ask for more with the flags, e.g. the demo's own budget:

    python -m bench.learning --algorithms mu-grpo grpo --mu 16 --num-stages 2 --prompts-per-update 4 \\
        --eval-prompts 100
    python -m bench.learning --algorithms grpo --mu 1 --num-stages 32 --rollout-mode colocated

Flags it does not know go to pretrain_mu_grpo.py unchanged (e.g. --lr 2e-5 --adam-beta2 0.99). Greedy accuracy on
N held-out problems has a binomial standard error of about sqrt(p(1-p)/N): 0.05 at N = 100, so read differences
below ~0.1 on a single seed as noise.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from bench.harness import run_trainer
from megamu.algo import ALGORITHM_PRESETS
from megamu.observability.metrics import read_metrics


def run_preset(algorithm: str, save: Path, a: argparse.Namespace, extra: list[str], log: Path | None = None) -> dict:
    """Run pretrain_mu_grpo.py for one preset into ``save`` (its stdout and stderr go to ``log`` when given)."""
    flags = ["--algorithm", algorithm, "--mu", str(a.mu), "--num-stages", str(a.num_stages), "--prompts-per-update",
             str(a.prompts_per_update), "--n-samples-per-prompt", str(a.n_samples_per_prompt), "--eval-prompts",
             str(a.eval_prompts), "--rollout-mode", a.rollout_mode, "--seed", str(a.seed), *extra]
    return summarize(algorithm, save, a, run_trainer(flags, save, log=log).wall_s)


def summarize(algorithm: str, save: Path, a: argparse.Namespace, wall: float) -> dict:
    """One finished run's numbers from its metrics.jsonl (``rows``: every record, for callers that plot them)."""
    rows = read_metrics(save)
    evals = {r["label"]: r["accuracy"] for r in rows if r["kind"] == "eval"}
    return {
        "algorithm": algorithm,
        "updates": sum(r["kind"] == "update" for r in rows),
        "samples": a.num_stages * a.mu * a.prompts_per_update * a.n_samples_per_prompt,
        "wall_s": wall,
        "stage_rewards": [r["reward_mean"] for r in rows if r["kind"] == "stage"],
        "before": evals.get("base", float("nan")),
        "after": evals.get("final", float("nan")),
        "rows": rows,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--algorithms", nargs="+", default=["mu-grpo", "grpo"], choices=sorted(ALGORITHM_PRESETS))
    p.add_argument("--mu", type=int, default=2, help="updates per stage")
    p.add_argument("--num-stages", type=int, default=2)
    p.add_argument("--prompts-per-update", type=int, default=2)
    p.add_argument("--n-samples-per-prompt", type=int, default=8)
    p.add_argument("--eval-prompts", type=int, default=20, help="held-out problems for the greedy accuracy")
    p.add_argument("--rollout-mode", choices=["staged", "colocated"], default="staged")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--out", default=None, help="keep the runs here (default: a temporary directory)")
    a, extra = p.parse_known_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(a.out) if a.out else Path(tmp)
        results = []
        for algorithm in a.algorithms:
            save = out / algorithm
            if save.exists() and any(save.iterdir()):
                raise SystemExit(f"bench/learning.py: --out: {save} is not empty (a rerun would resume it)")
            results.append(run_preset(algorithm, save, a, extra))
            r = results[-1]
            print(f"[{algorithm}] greedy {r['before']:.3f} -> {r['after']:.3f} in {r['wall_s']:.0f}s", flush=True)
    print(f"\nμ = {a.mu}, {a.num_stages} stages, {a.prompts_per_update} prompts x {a.n_samples_per_prompt} samples "
          f"per update, {a.rollout_mode}, greedy accuracy on {a.eval_prompts} held-out prompts"
          + (f", extra flags: {' '.join(extra)}" if extra else ""))
    print(f" {'algorithm':<20} | updates | samples | wall-clock | stage rollout rewards      | greedy before -> after")
    for r in results:
        rewards = " ".join(f"{x:.2f}" for x in r["stage_rewards"][:8]) + (" ..." if len(r["stage_rewards"]) > 8 else "")
        print(f" {r['algorithm']:<20} | {r['updates']:>7} | {r['samples']:>7} | {r['wall_s']:>9.0f}s | {rewards:<26} |"
              f" {r['before']:.3f} -> {r['after']:.3f}")


if __name__ == "__main__":
    main()
