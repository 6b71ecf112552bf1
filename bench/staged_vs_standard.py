"""μ-GRPO staged vs standard GRPO colocated (μ = 4), side by side in one run on the same tiny CPU setup.

Same number of updates and of samples: staged runs S stages of μ = U/S updates; the baseline refreshes every 4 updates
with the engine kept alive and weights pushed in memory. Prints wall-clock and rollout-time ratios and weight syncs.

    python -m bench.staged_vs_standard [--updates 32] [--stages 2] [--model tiny|smollm2]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from bench.harness import report, run_trainer, tiny_llama


def trainer_rows(model: Path | None, save: Path, flags: list[str], eval_prompts: int = 0) -> list[dict]:
    """The metrics records of one trainer run on the bench's task: ``model`` (None: the demo's, on its task)."""
    # the tiny random model earns no math reward: score it with the toy digit reward instead
    task = ["--hf-checkpoint", str(model), "--reward-fn", "tests.e2e.rewards:has_digit"] if model else []
    return run_trainer([*task, "--eval-prompts", str(eval_prompts), "--n-samples-per-prompt", "8",
                        "--rollout-max-response-len", "48", "--micro-batch-size", "16", "--seed", "3", *flags],
                       save).rows


def bench_model(tmp: Path, kind: str, hidden: int) -> Path | None:
    """``tiny``: a random 4-layer llama of width ``hidden``; ``smollm2``: the demo's (None)."""
    return None if kind == "smollm2" else tiny_llama(tmp / "model", hidden)


def summary(name: str, rows: list[dict]) -> dict:
    stages = [r for r in rows if r["kind"] == "stage"]
    return {"case": name, "t_total": next(r["t_total"] for r in rows if r["kind"] == "run"),
            "t_rollout": sum(s["t_rollout"] for s in stages), "t_export": sum(s["t_export"] for s in stages),
            "t_train": sum(s["t_train"] for s in stages), "weight_syncs": len(stages),
            "updates": sum(r["kind"] == "update" for r in rows)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--updates", type=int, default=32)
    p.add_argument("--stages", type=int, default=2)
    p.add_argument("--prompts-per-update", type=int, default=2)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--model", choices=["tiny", "smollm2"], default="tiny", help="smollm2: the demo model and task")
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = bench_model(Path(tmp), a.model, a.hidden)
        b, mu = a.prompts_per_update, a.updates // a.stages
        staged = summary("μ-GRPO staged", trainer_rows(model, Path(tmp) / "staged", [
            "--algorithm", "mu-grpo", "--num-stages", str(a.stages), "--prompts-per-stage", str(mu * b),
            "--prompts-per-update", str(b)]))
        standard = summary("GRPO μ=4 colocated", trainer_rows(model, Path(tmp) / "standard", [
            "--algorithm", "grpo", "--rollout-mode", "colocated", "--num-stages", str(a.updates // 4),
            "--prompts-per-stage", str(4 * b), "--prompts-per-update", str(b)]))
    report(f"{a.updates} updates x {b} groups x 8 samples, model {a.model}", [staged, standard],
           baseline="μ-GRPO staged", ratio_of="t_total")


if __name__ == "__main__":
    main()
