"""Hostile programs in the process sandbox: each fails within its limit and leaves nothing behind."""

import os
import signal
import socket
import time
from dataclasses import replace

import pytest

from megamu.reward.sandbox import SandboxLimits, probe_isolation, run_python
from tests.processes import group_members
from tests.reward.sandbox_checks import nothing_left_behind

pytestmark = pytest.mark.sandbox  # one such test at a time over the workers (tests/reward/sandbox_checks.py)

# Programs that should finish get a generous wall clock (a loaded CI machine starts interpreters slowly); programs
# that never finish get SHORT, and the tests bound how long their failure takes.
LIMITS = SandboxLimits(wall_s=30.0, cpu_s=2, memory_bytes=512 << 20, max_processes=16, file_bytes=4 << 20)
SHORT = replace(LIMITS, wall_s=2.0)
ISOLATION = probe_isolation()
needs_namespaces = pytest.mark.skipif(not ISOLATION.namespaces,
                                      reason="mount/network/PID namespaces need root (this run: rlimits only)")
needs_process_cap = pytest.mark.skipif(os.geteuid() == 0 and ISOLATION.pids_cgroup is None,
                                       reason="as root a process count is only capped by a writable pids cgroup")


def run(source: str, limits: SandboxLimits = LIMITS, **kw):
    t0 = time.monotonic()
    with nothing_left_behind():
        result = run_python(source, limits=limits, **kw)
        assert group_members(result.pgid) == []
    return result, time.monotonic() - t0


def test_normal_program_runs_with_stdin_and_output():
    r, _ = run("import sys\nprint(sum(map(int, sys.stdin.read().split())))", stdin="2 3 4\n")
    assert (r.returncode, r.stdout, r.timed_out) == (0, "9\n", False)
    r, _ = run("import sys\nprint(repr(sys.stdin.read()))")  # not fed: stdin is at EOF at once
    assert r.stdout == "''\n"


def test_scrubbed_environment():
    r, _ = run("import os, sys\nprint(sorted(os.environ))\nprint(sys.path)")
    names = eval(r.stdout.splitlines()[0])  # noqa: S307 - our own program's repr output
    assert "PYTHONPATH" not in names and set(names) <= {"PATH", "LANG", "HOME", "PYTHONHASHSEED",
                                                        "PYTHONDONTWRITEBYTECODE", "PYTHONIOENCODING"}
    assert "megamu" not in r.stdout.splitlines()[1] and "site-packages" not in r.stdout.splitlines()[1]


def test_infinite_loop_is_killed_at_the_wall_clock_limit():
    r, elapsed = run("while True:\n    pass\n", limits=SHORT)
    assert r.returncode != 0  # None: killed at the wall clock; or SIGXCPU at the CPU limit
    assert elapsed < SHORT.wall_s + 5


def test_sleeping_background_child_does_not_survive():
    r, _ = run("import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(600)\nprint('parent done')")
    assert r.stdout == "parent done\n"


@needs_process_cap
def test_fork_bomb_is_capped_and_cleaned_up():
    r, elapsed = run("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n",
                     limits=SHORT)
    assert r.returncode != 0 and elapsed < SHORT.wall_s + 10
    # the cap itself: children that sleep are forked until fork fails
    r, _ = run("import os, time\nn = 0\ntry:\n    while n < 1000:\n        if os.fork() == 0:\n"
               "            time.sleep(60)\n            os._exit(0)\n        n += 1\n"
               "except OSError:\n    pass\nprint(n)")
    assert r.returncode == 0 and int(r.stdout) < LIMITS.max_processes


def test_memory_bomb_fails():
    # A CPU limit far from binding: with soft = hard the kernel answers the CPU limit with SIGKILL, and faulting in
    # the pages of the growing list is CPU time that a loaded machine stretches (CI saw such a kill, no MemoryError).
    limits = replace(LIMITS, cpu_s=20, memory_bytes=256 << 20)
    r, _ = run("x = bytearray(8 << 30)", limits=limits)
    assert r.returncode != 0 and "MemoryError" in r.stderr
    r, _ = run("xs = []\nwhile True:\n    xs.append(bytearray(16 << 20))", limits=limits)
    assert r.returncode != 0 and "MemoryError" in r.stderr


def test_the_program_is_the_oom_killers_first_choice():
    r, _ = run("print(open('/proc/self/oom_score_adj').read().strip())")
    assert (r.returncode, r.stdout) == (0, "1000\n")


def test_large_write_is_stopped_at_the_file_size_limit():
    r, _ = run("with open('big', 'wb') as f:\n    for _ in range(1024):\n        f.write(b'0' * (1 << 20))\n"
               "print('wrote 1 GB')")
    assert r.returncode != 0 and "wrote" not in r.stdout


def test_output_is_capped():
    r, _ = run("import sys\nwhile True:\n    sys.stdout.write('x' * 65536)", limits=SHORT)
    assert r.returncode != 0 and len(r.stdout) <= LIMITS.output_bytes


@needs_namespaces
def test_write_outside_the_working_directory_fails(tmp_path):
    target = tmp_path / "escaped.txt"
    r, _ = run(f"open({str(target)!r}, 'w').write('x')")
    assert r.returncode != 0 and "Read-only file system" in r.stderr
    assert not target.exists()


@needs_namespaces
def test_parent_environment_secrets_are_unreadable(monkeypatch):
    secret = "megamu-secret-" + os.urandom(8).hex()
    monkeypatch.setenv("MEGAMU_TEST_SECRET", secret)
    program = (f"import os\nfound = {secret!r} in str(dict(os.environ))\n"
               f"for p in os.listdir('/proc'):\n    try:\n"
               f"        found |= {secret!r}.encode() in open(f'/proc/{{p}}/environ', 'rb').read()\n"
               f"    except OSError:\n        pass\n"
               f"try:\n    found |= {secret!r}.encode() in open('/proc/{os.getpid()}/environ', 'rb').read()\n"
               f"except OSError:\n    pass\nprint('FOUND' if found else 'not found')")
    r, _ = run(program)
    assert r.stdout == "not found\n"


@needs_namespaces
def test_no_connection_to_a_local_port():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    server.settimeout(0.5)
    port = server.getsockname()[1]
    try:
        r, _ = run(f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1).sendall(b'hi')\n"
                   "print('connected')")
        assert r.returncode != 0 and "connected" not in r.stdout
        with pytest.raises(TimeoutError):
            server.accept()
    finally:
        server.close()


@needs_namespaces
def test_parent_cannot_be_signalled():
    received = []
    old = signal.signal(signal.SIGUSR1, lambda *_: received.append(1))
    try:
        r, _ = run(f"import os, signal\nfor pid in ({os.getpid()}, os.getppid()):\n    try:\n"
                   f"        os.kill(pid, signal.SIGUSR1)\n    except OSError:\n        pass\nprint('sent')")
        time.sleep(0.2)
    finally:
        signal.signal(signal.SIGUSR1, old)
    assert received == []
