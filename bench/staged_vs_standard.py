"""μ-GRPO staged vs standard GRPO colocated (μ = 4), side by side in one run on the same tiny CPU setup.

Same number of updates and of samples: staged runs S stages of μ = U/S updates; the baseline refreshes every 4 updates
with the engine kept alive and weights pushed in memory. Prints wall-clock and rollout-time ratios and weight syncs.

    .venv/bin/python bench/staged_vs_standard.py [--updates 32] [--stages 2] [--model tiny|smollm2]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from megamu.tiny import save_tiny_model  # noqa: E402


def trainer_rows(model: Path | None, save: Path, flags: list[str], eval_prompts: int = 0) -> list[dict]:
    """Run pretrain_mu_grpo.py to completion in a subprocess; its metrics records."""
    # the tiny random model earns no math reward: score it with the e2e tests' digit reward instead
    task = ["--hf-checkpoint", str(model), "--reward-fn", "tests.e2e.rewards:has_digit"] if model else []
    cmd = [sys.executable, str(REPO / "pretrain_mu_grpo.py"), *task, "--save", str(save), "--eval-prompts",
           str(eval_prompts), "--n-samples-per-prompt", "8", "--rollout-max-response-len", "48",
           "--micro-batch-size", "16", "--seed", "3", *flags]
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_WAIT_POLICY="PASSIVE")
    subprocess.run(cmd, cwd=REPO, env=env, check=True, capture_output=True)
    return [json.loads(x) for x in (save / "metrics.jsonl").read_text().splitlines()]


def bench_model(tmp: Path, kind: str, hidden: int) -> Path | None:
    """``tiny``: a random 4-layer llama of width ``hidden`` (scored by the digit reward); ``smollm2``: the demo's."""
    if kind == "smollm2":
        return None
    return save_tiny_model(tmp / "model", "llama", hidden_size=hidden, intermediate_size=hidden * 3,
                           num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4)


def run(model: Path | None, save: Path, flags: list[str]) -> dict:
    t0 = time.perf_counter()
    rows = trainer_rows(model, save, flags)
    wall = time.perf_counter() - t0
    stages = [r for r in rows if r["kind"] == "stage"]
    return {
        "wall_s": wall,
        "t_total": next(r["t_total"] for r in rows if r["kind"] == "run"),
        "t_rollout": sum(s["t_rollout"] for s in stages),
        "t_export": sum(s["t_export"] for s in stages),
        "t_train": sum(s["t_train"] for s in stages),
        "weight_syncs": len(stages),
        "updates": sum(r["kind"] == "update" for r in rows),
    }


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
        b = a.prompts_per_update
        mu = a.updates // a.stages
        staged = run(model, Path(tmp) / "staged", ["--algorithm", "mu-grpo", "--num-stages", str(a.stages),
                                                   "--prompts-per-stage", str(mu * b), "--prompts-per-update", str(b)])
        standard = run(model, Path(tmp) / "standard", [
            "--algorithm", "grpo", "--rollout-mode", "colocated", "--num-stages", str(a.updates // 4),
            "--prompts-per-stage", str(4 * b), "--prompts-per-update", str(b)])
    print(f"{'':<22}{'μ-GRPO staged':>16}{'GRPO μ=4 coloc.':>18}{'ratio std/staged':>18}")
    for key in ("t_total", "t_rollout", "t_export", "t_train", "weight_syncs", "updates"):
        s, g = staged[key], standard[key]
        ratio = f"{g / s:.2f}x" if s else "-"
        print(f"{key:<22}{s:>16.2f}{g:>18.2f}{ratio:>18}")


if __name__ == "__main__":
    main()
