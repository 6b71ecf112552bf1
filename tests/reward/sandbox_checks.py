"""Process and file checks for the sandbox tests: what a run left behind, found by process group, PID namespace and
working-directory prefix (never by process name).

Those checks see the whole machine, so a sandbox run of a test on the other pytest worker would read as one left
behind by this test. Every test that runs sandboxed programs therefore holds ``sandbox_exclusive`` (tests marked
``sandbox``, through tests/conftest.py, and every ``nothing_left_behind`` block): one such test at a time."""

from __future__ import annotations

import fcntl
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


_held = 0  # this process's depth of sandbox_exclusive (a marked test's block may nest nothing_left_behind)


@contextmanager
def sandbox_exclusive():
    """No other pytest worker runs sandboxed programs inside this block (a lock file in the temp folder)."""
    global _held
    if _held:
        _held += 1
        try:
            yield
        finally:
            _held -= 1
        return
    with open(os.path.join(tempfile.gettempdir(), "megamu-sandbox-tests.lock"), "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        _held = 1
        try:
            yield
        finally:
            _held = 0
            fcntl.flock(f, fcntl.LOCK_UN)


@contextmanager
def nothing_left_behind():
    """Asserts that the block leaves no new process in another PID namespace and no sandbox directory."""
    with sandbox_exclusive():
        procs, dirs = foreign_namespace_pids(), run_dirs()
        yield
        assert foreign_namespace_pids() - procs == set(), "a sandboxed process outlived its run"
        assert run_dirs() - dirs == set(), "a sandbox directory was not removed"
