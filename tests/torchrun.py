"""Launch a worker script on N ranks of one node (gloo, CPU; torchrun's environment, forked by tests/warm_launch.py)
from a test, with a hard timeout; free ports for the servers a test launches are tests/ports.py's."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from megamu.runtime.net import free_port  # noqa: F401  (tests import it from here)
from tests.ports import server_ports  # noqa: F401  (tests import it from here)
from tests.warm_launch import warm_launcher


def run_torchrun(script: str | Path, nproc: int, *args: str, timeout: float = 300, env: dict | None = None):
    """Run ``script`` on ``nproc`` ranks of one node, forked from this worker's warm-launch server with torchrun's
    environment (tests/warm_launch.py); raise AssertionError with the output tail if it fails or times out."""
    full_env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **(env or {}))
    try:
        proc = warm_launcher().run(list(args), env=full_env, timeout=timeout, nproc=nproc, script=Path(script))
    except subprocess.TimeoutExpired as e:
        raise AssertionError(f"torchrun {script} timed out after {timeout}s:\n{(e.stdout or '')[-4000:]}") from e
    if proc.returncode != 0:
        raise AssertionError(
            f"torchrun {script} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"
        )
    return proc


def rank_main(main, *args) -> None:
    """A worker's entry: ``main(*args)``, then its process groups torn down, whatever happened. Groups left up at exit
    once aborted a rank after its work was done ("terminate called without an active exception")."""
    from megamu.runtime.parallel import destroy_distributed

    try:
        main(*args)
    finally:
        destroy_distributed()
