"""First code of a sandboxed run: started as ``python -I -S sandbox_init.py NAMESPACED PROGRAM`` in the fresh working
directory by ``megamu.reward.sandbox``. Standalone on purpose (no megamu import: the sandbox has no PYTHONPATH).

When NAMESPACED is 1 the process was started in new mount, network and PID namespaces (see ``sandbox.py``). Only
this process's children enter the new PID namespace, so it forks once: the child is PID 1 there (it cannot see or
signal any process outside, and when it exits the kernel kills everything left in the namespace). The child makes
every mount read-only except the working directory, mounts a fresh read-only /proc (no other process's environ or
cmdline to read), drops every capability, and runs PROGRAM as ``__main__``. The parent waits and passes the exit
status on; PR_SET_PDEATHSIG ties the child's life to it, so killing this process group ends the whole run.
"""

import ctypes
import os
import runpy
import signal
import sys

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
PR_SET_PDEATHSIG, PR_CAPBSET_DROP, PR_SET_NO_NEW_PRIVS, PR_CAP_AMBIENT = 1, 24, 38, 47
PR_CAP_AMBIENT_CLEAR_ALL = 4
FLAG_OPTIONS = {"nosuid": MS_NOSUID, "nodev": MS_NODEV, "noexec": MS_NOEXEC}
SETUP_FAILED = 125  # exit status for "the sandbox could not be set up": the run counts as failed

libc = ctypes.CDLL(None, use_errno=True)


def _check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _mount(source, target: str, fstype, flags: int) -> None:
    _check(libc.mount(source and source.encode(), target.encode(), fstype and fstype.encode(), flags, None),
           f"mount {target}")


def _mount_points() -> list[tuple[str, int]]:
    """(mount point, nosuid/nodev/noexec flags) of every mount, from /proc/self/mountinfo (octal escapes decoded)."""
    out = []
    with open("/proc/self/mountinfo", encoding="utf-8") as f:
        for line in f:
            fields = line.split()
            point = fields[4].encode().decode("unicode_escape").encode("latin-1").decode("utf-8", "replace")
            flags = sum(FLAG_OPTIONS.get(o, 0) for o in fields[5].split(","))
            out.append((point, flags))
    return out


def _isolate_filesystem() -> None:
    cwd = os.getcwd()
    _mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing below propagates back to the host
    _mount(cwd, cwd, None, MS_BIND)  # the working directory becomes its own mount, the only writable one
    os.chdir(cwd)  # enter the new mount (the old cwd reference points under it)
    for point, flags in _mount_points():
        if point == cwd:
            continue
        if libc.mount(None, point.encode(), None, MS_REMOUNT | MS_BIND | MS_RDONLY | flags, None) != 0 and point == "/":
            _check(-1, "remount / read-only")
    _mount("proc", "/proc", "proc", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC)


def _drop_privileges() -> None:
    for cap in range(64):
        libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0)  # EINVAL past the kernel's last capability: fine
    libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)
    _check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
    header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this thread
    data = (ctypes.c_uint32 * 6)()  # effective, permitted, inheritable = 0 (two 32-bit words each)
    _check(libc.capset(header, data), "capset")


def _run(program: str) -> None:
    sys.argv = [program]
    runpy.run_path(program, run_name="__main__")


def main() -> None:
    namespaced, program = sys.argv[1] == "1", sys.argv[2]
    if namespaced:
        pid = os.fork()
        if pid:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            _, status = os.waitpid(pid, 0)
            os._exit(os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status))
        try:
            _check(libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "pdeathsig")
            _isolate_filesystem()
            _drop_privileges()
        except OSError as e:
            print(f"megamu sandbox setup failed: {e}", file=sys.stderr, flush=True)
            os._exit(SETUP_FAILED)
    _run(program)


if __name__ == "__main__":
    main()
