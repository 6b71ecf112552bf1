"""tests/warm_launch.py's worlds: ranks forked with torchrun's environment, stopped as torchrun's agent stops them."""

import os
import time

import pytest

from tests.processes import pid_alive
from tests.warm_launch import STOP_GRACE_S, warm_launcher

RANK = """import os, sys, time
r = int(os.environ["RANK"])
print(f"rank {r} of {os.environ['WORLD_SIZE']} local {os.environ['LOCAL_RANK']} pid {os.getpid()}", flush=True)
if r == int(sys.argv[1]):
    sys.exit(int(sys.argv[2]))
time.sleep(float(sys.argv[3]))
"""


def _pids(stdout: str) -> list[int]:
    return [int(line.rsplit(" ", 1)[1]) for line in stdout.splitlines() if line.startswith("rank ")]


@pytest.mark.slow
def test_a_failed_rank_stops_the_world_with_its_exit_code(tmp_path):
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    t0 = time.monotonic()
    proc = warm_launcher().run(["1", "3", "600"], env=dict(os.environ), timeout=120, nproc=2, script=script)
    assert proc.returncode == 3, proc
    assert "rank 0 of 2 local 0" in proc.stdout and "rank 1 of 2 local 1" in proc.stdout
    assert time.monotonic() - t0 < 60 + STOP_GRACE_S  # rank 0 was stopped, not waited out (600 s)
    assert not any(pid_alive(p) for p in _pids(proc.stdout))


@pytest.mark.slow
def test_a_world_whose_ranks_all_end_well_returns_zero(tmp_path):
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    proc = warm_launcher().run(["-1", "0", "0.5"], env=dict(os.environ), timeout=120, nproc=3, script=script)
    assert proc.returncode == 0 and len(set(_pids(proc.stdout))) == 3, proc
