"""Process checks shared by tests that must prove no worker or server outlives its owner."""

import contextlib
import os
import signal
import subprocess


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie counts as gone
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def run_owned(cmd: list[str], *, timeout: float, **kwargs) -> subprocess.CompletedProcess:
    """``subprocess.run(cmd, capture_output=True, text=True)`` in a session of its own: on a timeout, or when the test
    itself is interrupted (pytest-timeout, Ctrl-C), the whole process tree is killed, not only ``cmd``. torchrun's
    ranks would otherwise outlive a killed launcher, holding a barrier and two cores until the machine is rebooted."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            **kwargs)
    try:
        out, err = proc.communicate(timeout=timeout)
    except BaseException:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def group_members(pgid: int) -> list[int]:
    """Every live process in process group ``pgid`` (a server's scheduler and detokenizer, a sandbox's children)."""
    out = subprocess.run(["ps", "-eo", "pid=,pgid=,stat="], capture_output=True, text=True, check=True).stdout
    return [int(p) for p, g, s in (line.split()[:3] for line in out.splitlines()) if int(g) == pgid and s[0] != "Z"]
