"""Launching `pretrain_mu_grpo.py` from a test and reading what the run wrote (shared by every tests/e2e module)."""

import json
import os
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

from tests.ports import server_ports
from tests.processes import run_owned
from tests.warm_launch import warm_launcher

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "pretrain_mu_grpo.py"
MU, STAGES = 4, 2


def flags(model: Path, save: Path, *extra: str) -> list[str]:
    return [
        "--hf-checkpoint", str(model), "--save", str(save), "--num-stages", str(STAGES), "--prompts-per-stage", "8",
        "--prompts-per-update", "2", "--n-samples-per-prompt", "4", "--rollout-max-response-len", "12",
        "--eval-prompts", "4", "--lr", "1e-3", "--reward-fn", "tests.e2e.rewards:has_digit", "--micro-batch-size", "4",
        "--rollout-groups-per-shard", "2", "--save-interval", "2", "--seed", "7",
        # every sample in every update, so each update has a ratio to check (skipping A = 0 is tested too)
        "--no-skip-zero-advantage", *extra,
    ]


def launch(args: list[str], *, nproc: int = 1, env: dict | None = None, check: bool = True, torchrun: bool = False):
    """Run the trainer to its end: forked from a process that imported it once (tests/warm_launch.py), one rank or a
    one-node world of ``nproc``; or, with ``torchrun``, under torchrun from scratch (for what its agent does)."""
    full_env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **(env or {}))
    if torchrun:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_addr",
               "127.0.0.1", "--master_port", str(server_ports()), str(SCRIPT), *args]  # below the ephemeral range
        proc = run_owned(cmd, cwd=REPO, env=full_env, timeout=600)
    else:
        proc = warm_launcher().run(args, env=full_env, timeout=600, nproc=nproc)
    if check and proc.returncode != 0:
        raise AssertionError(f"{proc.args} (nproc {nproc}) failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n"
                             f"{proc.stderr[-5000:]}")
    return proc


def records(save: Path, kind: str) -> list[dict]:
    rows = [json.loads(line) for line in (save / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["kind"] == kind]


def final_weights(save: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted((save / "hf" / "final").glob("*.safetensors")):
        out.update(load_file(f))
    return out
