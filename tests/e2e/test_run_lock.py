"""One run per run directory, end to end (issue 50 item 7): the same launch twice at once on one --save, and a
relaunch after kill -9. The tiny model and the uninterrupted reference run are tests/e2e/conftest.py's."""

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from megamu.run.run_lock import LOCK
from tests.e2e.runs import MU, REPO, SCRIPT, STAGES, final_weights, flags, launch, records

ENV = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")


def start(args: list[str]) -> subprocess.Popen:
    """The trainer launched in the background (its own session: kill -9 reaches its reward workers too)."""
    return subprocess.Popen([sys.executable, str(SCRIPT), *args], cwd=REPO, env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def wait_for(path, proc: subprocess.Popen, timeout: float = 180) -> None:
    end = time.monotonic() + timeout
    while not path.exists():
        assert proc.poll() is None, f"the first launch ended before taking its lock:\n{proc.stdout.read()[-3000:]}"
        assert time.monotonic() < end, f"no {path} after {timeout} s"
        time.sleep(0.1)


def kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


@pytest.mark.slow
def test_a_second_launch_on_one_save_is_refused_and_a_killed_runs_lock_is_taken_over(tiny, reference, tmp_path):
    save = tmp_path / "run"
    first = start(flags(tiny, save))
    try:
        wait_for(save / LOCK, first)
        second = launch(flags(tiny, save), check=False)
        assert first.poll() is None, "the first run ended before the second was refused: the test proves nothing"
        assert second.returncode != 0
        assert f"another run is using this run directory: host {os.uname().nodename}, pid {first.pid}" \
            in second.stderr, second.stderr[-2000:]
        out, _ = first.communicate(timeout=600)
        assert first.returncode == 0, out[-3000:]
    finally:
        kill(first)
    # the first finished as if alone: every update recorded once, the uninterrupted run's weights bit for bit
    assert [u["update"] for u in records(save, "update")] == list(range(STAGES * MU))
    ref, got = final_weights(reference), final_weights(save)
    assert ref.keys() == got.keys() and all(torch.equal(ref[k], got[k]) for k in ref)
    assert not (save / LOCK).exists()  # given back at its end

    killed_save = tmp_path / "killed"
    killed = start(flags(tiny, killed_save))
    try:
        wait_for(killed_save / LOCK, killed)
    finally:
        kill(killed)  # kill -9: the lock file stays behind, its heartbeat fresh
    assert (killed_save / LOCK).exists()
    relaunch = launch(flags(tiny, killed_save))
    assert f"took over the lock of a run that is gone ({{'host': '{os.uname().nodename}', 'pid': {killed.pid}" \
        in relaunch.stdout
    assert [u["update"] for u in records(killed_save, "update")] == list(range(STAGES * MU))
