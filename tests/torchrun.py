"""Launch a worker script on N ranks of one node (gloo, CPU; torchrun's environment, forked by tests/warm_launch.py)
from a test, with a hard timeout; and free ports for the servers a test launches."""

from __future__ import annotations

import os
import random
import socket
import subprocess
import time
from pathlib import Path

from megamu.runtime.net import free_port  # noqa: F401  (tests import it from here)
from tests.warm_launch import warm_launcher


def server_ports(span: int = 1) -> int:
    """A base port with ports base .. base + span - 1 free now, for servers a test launches at fixed offsets (the
    SGLang launcher's port_base + i, a node's + 10). Drawn below Linux's ephemeral range (32768 and up), where every
    client connection of every test running beside this one takes its port: a port next to a free ephemeral one is
    often such a connection's (seen with two pytest workers)."""
    rng = random.Random(os.getpid() ^ time.time_ns())
    for _ in range(500):
        base = rng.randrange(20000, 32768 - span)
        if all(_bindable(base + i) for i in range(span)):
            return base
    raise RuntimeError(f"no {span} free ports in a row below 32768")


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


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
