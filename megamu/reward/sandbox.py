"""Run an untrusted Python program in a process sandbox: the execution half of the code reward.

Every run gets:
  - a fresh temporary working directory holding the program, removed after the run;
  - its own session and process group, killed whole (SIGKILL) at the wall-clock limit or when the run ends;
  - the OOM killer's first choice (oom_score_adj 1000, inherited by its children);
  - resource limits: CPU seconds, address space, file size (also caps stdout/stderr, which go to files), open files,
    no core dumps, and RLIMIT_NPROC (which only binds non-root users: the kernel never applies it to uid 0);
  - a scrubbed environment (PATH, LANG, HOME=the working directory; no secrets, no PYTHONPATH) and ``python -I -S``
    (no user site, no site-packages: the standard library only);
  - stdin from /dev/null unless the test feeds it; stdout/stderr captured up to ``output_bytes``.
When the process is root (``Isolation.namespaces``), also new mount, network and PID namespaces
(``sandbox_init.py``): the only writable directory is the working directory (every other mount is read-only, so a
write anywhere else fails; /dev/shm too, so no POSIX semaphores for multiprocessing), there is no network device but
an unconfigured loopback (no connection to the host's 127.0.0.1 or anywhere), /proc shows only the sandbox's
processes, no process outside can be signalled, and every capability is dropped (no remount, no raising limits).
With a writable pids cgroup (``Isolation.pids_cgroup``) a run is also capped at ``max_processes`` tasks, which
bounds a fork bomb even as root; every task left in the cgroup is killed at the end.

Not isolated: the file system stays readable (anything the trainer's user can read, the program can read and print);
CPU time and memory are limited per process, not per run (up to ``max_processes`` x ``memory_bytes`` in all); disk
use is bounded only per file (many files can still be written in the working directory, which is deleted
afterwards); without namespaces (non-root, or a container without CAP_SYS_ADMIN) the network, the file system and
other processes of the same user are reachable, and a child that leaves the process group (``setsid``) outlives the
run unless a pids cgroup holds it; without a pids cgroup a fork bomb as root is bounded only by the wall-clock limit.
A test program and the solution share one interpreter, so a program that reads its own source can forge the
end-of-tests marker. A worker killed by the pool's per-item timeout takes its run with it (PR_SET_PDEATHSIG) but
leaves the run's directories, removed by the next ``probe_isolation`` of any process. The sandbox forks through
``preexec_fn``: call it from a single-threaded process (a reward worker).

This is a process sandbox, not a VM: for untrusted models at scale use ``--code-sandbox-url``
(``megamu.reward.remote``) with a hardened remote sandbox service.
"""

from __future__ import annotations

import functools
import os
import resource
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

INIT = str(Path(__file__).with_name("sandbox_init.py"))
CLONE_NEWNS, CLONE_NEWPID, CLONE_NEWNET = 0x00020000, 0x20000000, 0x40000000
PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class SandboxLimits:
    wall_s: float = 10.0
    cpu_s: int = 10
    memory_bytes: int = 1 << 30
    max_processes: int = 32
    file_bytes: int = 16 << 20
    open_files: int = 64
    output_bytes: int = 1 << 20


DEFAULT_LIMITS = SandboxLimits()


@dataclass(frozen=True)
class Isolation:
    """What this machine allows, probed once per process (``probe_isolation``) and passed to every run."""

    namespaces: bool  # mount + network + PID namespaces (root only)
    pids_cgroup: str | None  # a cgroup directory under which per-run cgroups with pids.max can be made


@dataclass
class RunResult:
    returncode: int | None  # None: killed at the wall-clock limit
    stdout: str
    stderr: str
    timed_out: bool
    pgid: int  # the run's process group (= the first process's pid), for leak checks


def _pids_cgroup_root() -> str | None:
    """Our own cgroup in the pids hierarchy (v1, or v2 with pids delegated), if we may make sub-cgroups there."""
    try:
        mounts = Path("/proc/self/mounts").read_text().splitlines()
        memberships = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in mounts:
        _, point, fstype, opts, *_ = line.split()
        own = None
        if fstype == "cgroup" and "pids" in opts.split(","):
            own = next((m.split(":", 2)[2] for m in memberships if "pids" in m.split(":", 2)[1].split(",")), None)
        elif fstype == "cgroup2":
            own = next((m.split(":", 2)[2] for m in memberships if m.startswith("0::")), None)
        if own is None:
            continue
        base = Path(point) / own.lstrip("/")
        probe = base / f"megamu-probe-{os.getpid()}"
        try:
            probe.mkdir()
            try:
                (probe / "pids.max").write_text("8")
            finally:
                probe.rmdir()
            return str(base)
        except OSError:
            continue
    return None


def _remove_stale(root: str, prefixes: tuple[str, ...], remove) -> None:
    """Remove what runs of dead processes left (a worker killed by the pool's per-item timeout cannot clean up):
    names carry the creating process's pid."""
    try:
        names = os.listdir(root)
    except OSError:
        return
    for name in names:
        prefix = next((p for p in prefixes if name.startswith(p)), None)
        pid = name[len(prefix):].split("-", 1)[0] if prefix else ""
        if not pid.isdigit() or int(pid) == os.getpid() or os.path.exists(f"/proc/{pid}"):
            continue
        try:
            remove(os.path.join(root, name))
        except OSError:  # still in use (a cgroup with tasks) or already gone
            pass


def remove_stale_runs(cgroup_root: str | None) -> None:
    """Directories and (empty) cgroups of runs whose process is gone."""
    _remove_stale(tempfile.gettempdir(), ("megamu-run-", "megamu-io-"), shutil.rmtree)
    if cgroup_root:
        _remove_stale(cgroup_root, ("megamu-sandbox-",), os.rmdir)


def _works(isolation: Isolation) -> bool:
    try:
        r = run_python("import sys; sys.stdout.write('ok')", isolation=isolation, limits=SandboxLimits(wall_s=30.0))
    except (OSError, subprocess.SubprocessError):  # e.g. unshare or the cgroup refused in the child
        return False
    return r.returncode == 0 and r.stdout == "ok"


@functools.lru_cache(maxsize=1)
def probe_isolation() -> Isolation:
    """Decide once per process what this machine allows, by running a trivial program under each candidate, most
    isolated first; what a weaker choice leaves open is in the module docstring."""
    cgroup = _pids_cgroup_root()
    remove_stale_runs(cgroup)
    namespaces = [True, False] if os.geteuid() == 0 else [False]
    cgroups = [cgroup, None] if cgroup else [None]
    for ns in namespaces:
        for cg in cgroups:
            if _works(Isolation(ns, cg)):
                return Isolation(ns, cg)
    raise RuntimeError("the code sandbox cannot start even a trivial program on this machine")


def _scrubbed_env(cwd: str) -> dict[str, str]:
    return {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": cwd, "PYTHONHASHSEED": "0",
            "PYTHONDONTWRITEBYTECODE": "1", "PYTHONIOENCODING": "utf-8"}


def _prepare_child(limits: SandboxLimits, isolation: Isolation, cgroup: str | None):
    """preexec_fn: runs in the forked child before exec (the worker is single-threaded, so this is safe)."""
    import ctypes

    def prepare() -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # the worker dies: so does the run
        try:  # under memory pressure the kernel's OOM killer takes the untrusted program first, not the trainer
            Path("/proc/self/oom_score_adj").write_text("1000")
        except OSError:
            pass
        if cgroup is not None:
            with open(os.path.join(cgroup, "cgroup.procs"), "w") as f:
                f.write(str(os.getpid()))
        for which, value in ((resource.RLIMIT_CPU, limits.cpu_s), (resource.RLIMIT_AS, limits.memory_bytes),
                             (resource.RLIMIT_FSIZE, limits.file_bytes), (resource.RLIMIT_NOFILE, limits.open_files),
                             (resource.RLIMIT_NPROC, limits.max_processes), (resource.RLIMIT_CORE, 0)):
            resource.setrlimit(which, (value, value))
        if isolation.namespaces and libc.unshare(CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWPID) != 0:
            raise OSError(ctypes.get_errno(), "unshare")

    return prepare


def _make_cgroup(root: str, max_processes: int) -> str | None:
    """A fresh cgroup capped at ``max_processes`` tasks for one run; None if the cgroup file system refuses."""
    for attempt in range(100):
        path = os.path.join(root, f"megamu-sandbox-{os.getpid()}-{time.monotonic_ns()}-{attempt}")
        try:
            os.mkdir(path)
        except FileExistsError:
            continue
        except OSError:
            return None
        try:
            Path(path, "pids.max").write_text(str(max_processes))
        except OSError:
            os.rmdir(path)
            return None
        return path
    return None


def _kill_cgroup(path: str) -> None:
    """SIGKILL every task left in the run's cgroup until it is empty, then remove it."""
    deadline = time.monotonic() + 10.0
    while time.monotonic() < deadline:
        try:
            pids = [int(p) for p in Path(path, "cgroup.procs").read_text().split()]
        except OSError:
            return
        if not pids:
            try:
                os.rmdir(path)
                return
            except OSError:  # tasks still exiting
                pass
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.002)


def _wait_exit(proc: subprocess.Popen, timeout_s: float) -> bool:
    """Whether ``proc`` exited within ``timeout_s``. A pidfd wakes us at the exit; Popen.wait(timeout) would poll
    with sleeps of up to 50 ms, a large part of a short run."""
    try:
        fd = os.pidfd_open(proc.pid)
    except (AttributeError, OSError):  # kernels before 5.3
        try:
            proc.wait(timeout_s)
            return True
        except subprocess.TimeoutExpired:
            return False
    try:
        ready, _, _ = select.select([fd], [], [], timeout_s)
    finally:
        os.close(fd)
    if ready:
        proc.wait()
    return bool(ready)


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the run's process group (also after a normal exit: background children) and wait until every member
    is gone, so that the run's processes (PID-namespace init included) are reaped when ``run_python`` returns."""
    deadline = time.monotonic() + 10.0
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()
    while time.monotonic() < deadline:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # also reaches members forked after the first kill
        except ProcessLookupError:
            return
        time.sleep(0.002)


def _read_capped(path: str, cap: int) -> str:
    with open(path, "rb") as f:
        return f.read(cap).decode("utf-8", "replace")


def run_python(source: str, *, stdin: str | None = None, limits: SandboxLimits = DEFAULT_LIMITS,
               isolation: Isolation | None = None) -> RunResult:
    """Run ``source`` as ``__main__`` in a sandbox (see the module docstring); returns its status and output."""
    isolation = probe_isolation() if isolation is None else isolation
    cwd = tempfile.mkdtemp(prefix=f"megamu-run-{os.getpid()}-")
    # stdin/stdout/stderr files live outside the working directory: read-only to the program
    io_dir = tempfile.mkdtemp(prefix=f"megamu-io-{os.getpid()}-")
    cgroup = _make_cgroup(isolation.pids_cgroup, limits.max_processes) if isolation.pids_cgroup else None
    proc = None
    try:
        Path(cwd, "main.py").write_text(source, encoding="utf-8")
        stdin_path = os.path.join(io_dir, "stdin")
        Path(stdin_path).write_text(stdin or "", encoding="utf-8")
        with open(stdin_path if stdin is not None else os.devnull, "rb") as fin, \
                open(os.path.join(io_dir, "stdout"), "wb") as fout, open(os.path.join(io_dir, "stderr"), "wb") as ferr:
            proc = subprocess.Popen(
                [sys.executable, "-I", "-S", INIT, "1" if isolation.namespaces else "0", "main.py"],
                cwd=cwd, env=_scrubbed_env(cwd), stdin=fin, stdout=fout, stderr=ferr, close_fds=True,
                start_new_session=True, preexec_fn=_prepare_child(limits, isolation, cgroup),
            )
            timed_out = not _wait_exit(proc, limits.wall_s)
        return RunResult(
            returncode=None if timed_out else proc.returncode,
            stdout=_read_capped(os.path.join(io_dir, "stdout"), limits.output_bytes),
            stderr=_read_capped(os.path.join(io_dir, "stderr"), limits.output_bytes),
            timed_out=timed_out, pgid=proc.pid,
        )
    finally:
        if proc is not None:
            _kill_group(proc)
        if cgroup is not None:
            _kill_cgroup(cgroup)
        shutil.rmtree(cwd, ignore_errors=True)
        shutil.rmtree(io_dir, ignore_errors=True)
