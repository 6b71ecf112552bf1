"""The run-directory lock (issue 50 item 7): a second holder is refused naming the first; a holder that is gone is
taken over (its pid gone on this host, or its heartbeat stale from another); with and without flock."""

import json
import os
import subprocess
import sys
import time

import pytest

from megamu.run.run_lock import LOCK, RunDirLocked, RunLock

HOLD = """
import sys, time
from megamu.run.run_lock import RunLock
lock = RunLock(sys.argv[1], heartbeat_s=0.2, use_flock=sys.argv[2] == "1").acquire()
print("held", flush=True)
time.sleep(60)
"""


@pytest.fixture(params=[True, False], ids=["flock", "lock-file-only"])
def use_flock(request):
    return request.param


def hold(root, use_flock: bool) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(root), "1" if use_flock else "0"],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def write_lock(root, **fields) -> None:
    root.mkdir(parents=True, exist_ok=True)
    (root / LOCK).write_text(json.dumps({"since": "earlier", "command": "pretrain_mu_grpo.py", **fields}))


def test_a_second_holder_is_refused_naming_the_first(tmp_path, use_flock):
    first = hold(tmp_path, use_flock)
    try:
        with pytest.raises(RunDirLocked, match=rf"--save {tmp_path}: another run .*pid {first.pid}") as refused:
            RunLock(tmp_path, use_flock=use_flock).acquire()
        assert os.uname().nodename in str(refused.value)
        assert json.loads((tmp_path / LOCK).read_text())["pid"] == first.pid  # the holder's lock is untouched
    finally:
        first.kill()
        first.wait()


def test_a_killed_holder_on_this_host_is_taken_over_at_once(tmp_path, use_flock):
    first = hold(tmp_path, use_flock)
    first.kill()  # kill -9: no cleanup, the lock file stays with a fresh heartbeat
    first.wait()
    assert json.loads((tmp_path / LOCK).read_text())["pid"] == first.pid
    lock = RunLock(tmp_path, use_flock=use_flock).acquire()
    try:
        assert lock.taken_over["pid"] == first.pid
        assert json.loads((tmp_path / LOCK).read_text())["pid"] == os.getpid()
    finally:
        lock.release()
    assert not (tmp_path / LOCK).exists()  # given back on release


def test_a_lock_of_a_dead_pid_on_this_host_is_stale_whatever_its_heartbeat(tmp_path, use_flock):
    write_lock(tmp_path, host=os.uname().nodename, pid=dead_pid(), heartbeat=time.time())
    with RunLock(tmp_path, use_flock=use_flock) as lock:
        assert lock.taken_over is not None


def test_another_hosts_lock_holds_until_its_heartbeat_is_stale(tmp_path, use_flock):
    write_lock(tmp_path, host="node-7", pid=1234, heartbeat=time.time() - 5)
    with pytest.raises(RunDirLocked, match=r"host node-7, pid 1234, since earlier \(heartbeat 5 s ago"):
        RunLock(tmp_path, stale_s=60, use_flock=use_flock).acquire()
    write_lock(tmp_path, host="node-7", pid=1234, heartbeat=time.time() - 61)
    with RunLock(tmp_path, stale_s=60, use_flock=use_flock) as lock:
        assert lock.taken_over["host"] == "node-7"


def test_the_holder_keeps_its_heartbeat_fresh_and_gives_the_lock_back(tmp_path):
    with RunLock(tmp_path, heartbeat_s=0.05) as lock:
        first = json.loads((tmp_path / LOCK).read_text())["heartbeat"]
        time.sleep(0.3)
        later = json.loads((tmp_path / LOCK).read_text())
        assert later["heartbeat"] > first and later["pid"] == os.getpid() and lock.taken_over is None
    assert not (tmp_path / LOCK).exists()
    with RunLock(tmp_path):  # free again
        pass
