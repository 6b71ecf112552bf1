"""The host memory a job may use: its cgroup's limit when one is set, else the machine's RAM.

A job under a scheduler (Slurm's cgroup plugin, Kubernetes, docker --memory) is killed by the kernel's OOM killer at
its cgroup's limit, whatever the machine has; the host-memory plan must be checked against that limit. Read, in
order: cgroup v2 (``memory.max`` of the process's cgroup, from ``/proc/self/cgroup``'s ``0::/path`` line, and of
each parent up to the mount: the smallest limit applies; "max" = none), then cgroup v1 (``memory.limit_in_bytes`` of
the ``memory`` controller's cgroup; v1 writes "no limit" as a page-rounded 2^63 - 1, so a value at or above the RAM is
none).
"""

from __future__ import annotations

from pathlib import Path

import psutil

CGROUP_ROOT = "/sys/fs/cgroup"
PROC_CGROUP = "/proc/self/cgroup"


def _read_limit(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if text in ("", "max"):
        return None
    try:
        value = int(text)
    except ValueError:
        return None
    return value if value > 0 else None


def _memberships(proc_cgroup: str) -> list[tuple[str, str]]:
    """(controllers, path) of each line ``id:controllers:path`` of ``/proc/self/cgroup``."""
    try:
        lines = Path(proc_cgroup).read_text().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) == 3:
            out.append((parts[1], parts[2]))
    return out


def _limits_up(base: Path, rel: str, name: str) -> list[int]:
    """``name``'s limits in the cgroup at ``base/rel`` and each parent up to ``base``."""
    found = []
    here = Path(rel.strip("/")) if rel.strip("/") else Path()
    while True:
        limit = _read_limit(base / here / name)
        if limit is not None:
            found.append(limit)
        if here == Path():
            return found
        here = here.parent


def cgroup_memory_limit(root: str = CGROUP_ROOT, proc_cgroup: str = PROC_CGROUP) -> int | None:
    """Bytes this process's cgroup may use, or None when no limit is set (or none can be read)."""
    base = Path(root)
    members = _memberships(proc_cgroup)
    v2 = next((path for controllers, path in members if controllers == ""), None)
    limits = _limits_up(base, v2 if v2 is not None else "/", "memory.max")
    v1 = next((path for controllers, path in members if "memory" in controllers.split(",")), None)
    limits += _limits_up(base / "memory", v1 if v1 is not None else "/", "memory.limit_in_bytes")
    return min(limits) if limits else None


def host_memory_bytes(root: str = CGROUP_ROOT, proc_cgroup: str = PROC_CGROUP, ram: int | None = None) -> int:
    """The smaller of the machine's RAM and the cgroup's limit (a v1 "unlimited" is above the RAM: the RAM)."""
    ram = psutil.virtual_memory().total if ram is None else ram
    limit = cgroup_memory_limit(root, proc_cgroup)
    return ram if limit is None else min(ram, limit)
