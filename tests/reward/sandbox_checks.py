"""Process and file checks for the sandbox tests: what a run left behind, found by process group, PID namespace and
working-directory prefix (never by process name)."""

from __future__ import annotations

import glob
import os
import tempfile
from contextlib import contextmanager


def _stat_fields(pid: int) -> list[str] | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return None
    return text[text.rindex(")") + 2 :].split()  # state, ppid, pgrp, ...


def live_pids() -> list[int]:
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            fields = _stat_fields(int(name))
            if fields is not None and fields[0] != "Z":
                out.append(int(name))
    return out


def _pid_ns(pid: int | str) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/pid")
    except OSError:
        return None


def foreign_namespace_pids() -> set[int]:
    """Live processes in a PID namespace other than ours (where sandboxed programs run)."""
    own = _pid_ns("self")
    return {p for p in live_pids() if (ns := _pid_ns(p)) is not None and ns != own}


def run_dirs() -> set[str]:
    return set(glob.glob(os.path.join(tempfile.gettempdir(), "megamu-run-*"))) | set(
        glob.glob(os.path.join(tempfile.gettempdir(), "megamu-io-*")))


@contextmanager
def nothing_left_behind():
    """Asserts that the block leaves no new process in another PID namespace and no sandbox directory."""
    procs, dirs = foreign_namespace_pids(), run_dirs()
    yield
    assert foreign_namespace_pids() - procs == set(), "a sandboxed process outlived its run"
    assert run_dirs() - dirs == set(), "a sandbox directory was not removed"
