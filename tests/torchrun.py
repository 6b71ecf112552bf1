"""Launch a worker script under `torchrun --nproc_per_node N` (gloo, CPU) from a test, with a hard timeout."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from megamu.net import free_port  # noqa: F401  (tests import it from here)
from tests.processes import run_owned


def run_torchrun(script: str | Path, nproc: int, *args: str, timeout: float = 300, env: dict | None = None):
    """Run ``script`` on ``nproc`` ranks; raise AssertionError with the output tail if it fails or times out."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        str(nproc),
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(free_port()),
        str(script),
        *map(str, args),
    ]
    full_env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **(env or {}))
    try:
        proc = run_owned(cmd, timeout=timeout, env=full_env)
    except subprocess.TimeoutExpired as e:
        raise AssertionError(f"torchrun {script} timed out after {timeout}s:\n{(e.stdout or '')[-4000:]}") from e
    if proc.returncode != 0:
        raise AssertionError(
            f"torchrun {script} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"
        )
    return proc
