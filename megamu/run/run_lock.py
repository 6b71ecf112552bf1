"""One run per run directory: the lock a launch takes on ``--save`` before it writes anything there.

Two launches of the same command (a double submit, a requeue while the first still runs) would otherwise both train
into one folder: both append to metrics.jsonl and write the same checkpoints and exports with different bytes. The
second launch is refused at once, naming the holder; nothing of the first is touched.

Two mechanisms, since clusters put run directories on shared filesystems where one of them may not work:
- ``flock`` on ``.megamu-run.flock``, held for the run's life: exact on a local disk (the kernel drops it when the
  process dies, kill -9 included); on a filesystem without it (some NFS and FUSE mounts) it is skipped.
- ``.megamu-run.lock``, created with O_EXCL, saying who holds the directory (host, pid, since, command) and a
  heartbeat the holder rewrites every ``heartbeat_s``. A lock whose holder is gone is taken over: on the same host
  at once when its pid no longer exists, from another host once its heartbeat is older than ``stale_s`` (clocks
  kept within seconds by NTP, as a cluster's are).
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import sys
import threading
import time
from pathlib import Path

from megamu.runtime.atomic import atomic_write_text

LOCK = ".megamu-run.lock"
FLOCK = ".megamu-run.flock"
HEARTBEAT_S = 10.0
STALE_S = 60.0


class RunDirLocked(RuntimeError):
    """Another live run holds the run directory."""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: it exists
        return True
    return True


class RunLock:
    """The lock on run directory ``root``; ``acquire()`` takes it or raises ``RunDirLocked``, ``release()`` (or
    leaving the ``with`` block) gives it back."""

    def __init__(self, root: str | Path, heartbeat_s: float = HEARTBEAT_S, stale_s: float = STALE_S,
                 use_flock: bool = True):
        self.root = Path(root)
        self.path = self.root / LOCK
        self.heartbeat_s, self.stale_s, self.use_flock = heartbeat_s, stale_s, use_flock
        self.me = {"host": socket.gethostname(), "pid": os.getpid()}
        self.taken_over: dict | None = None  # the stale holder this lock replaced, if any
        self._fd: int | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- who holds it
    def holder(self) -> dict | None:
        try:
            return json.loads(self.path.read_text())
        except FileNotFoundError:
            return None
        except (json.JSONDecodeError, OSError):  # a holder caught mid-write by a reader: treat as held, fresh
            return {"host": "?", "pid": -1, "since": "?", "heartbeat": time.time()}

    def _stale(self, h: dict) -> bool:
        if h.get("host") == self.me["host"] and isinstance(h.get("pid"), int) and h["pid"] > 0:
            if not _alive(h["pid"]):
                return True
        return time.time() - float(h.get("heartbeat", 0)) > self.stale_s

    def _describe(self, h: dict) -> str:
        age = time.time() - float(h.get("heartbeat", 0))
        return (f"host {h.get('host')}, pid {h.get('pid')}, since {h.get('since')} (heartbeat {age:.0f} s ago; "
                f"command: {h.get('command', '?')})")

    # -- taking and giving back
    def _record(self, since: str) -> str:
        return json.dumps({**self.me, "since": since, "heartbeat": time.time(),
                           "command": " ".join(sys.argv)[:500]}) + "\n"

    def _flock(self) -> None:
        fd = os.open(self.root / FLOCK, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            h = self.holder()
            raise RunDirLocked(self._refusal(h)) from None
        except OSError as e:  # ENOLCK / EOPNOTSUPP: the filesystem has no flock; the lock file alone decides
            os.close(fd)
            if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                raise
            return
        self._fd = fd

    def _refusal(self, h: dict | None) -> str:
        who = self._describe(h) if h else "a process holding its flock (no lock file yet)"
        return (f"--save {self.root}: another run is using this run directory: {who}. Two runs in one directory "
                f"would overwrite each other's checkpoints and metrics: wait for it to end or stop it (a run killed "
                f"without cleanup is taken over at once on its own host, from elsewhere {self.stale_s:.0f} s after "
                f"its last heartbeat).")

    def acquire(self) -> RunLock:
        self.root.mkdir(parents=True, exist_ok=True)
        if self.use_flock:
            self._flock()
        since = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
        for _ in range(2):  # a second try only after taking over a stale lock
            try:
                fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                h = self.holder()
                if h is None:
                    continue  # released between our open and our read
                if not self._stale(h):
                    self._unflock()
                    raise RunDirLocked(self._refusal(h)) from None
                # rename, not unlink: of two launches taking over at once, only one rename finds the stale file
                try:
                    os.replace(self.path, self.path.with_name(f"{LOCK}.stale-{os.getpid()}"))
                except FileNotFoundError:
                    continue
                self.path.with_name(f"{LOCK}.stale-{os.getpid()}").unlink(missing_ok=True)
                self.taken_over = h
                continue
            with os.fdopen(fd, "w") as f:
                f.write(self._record(since))
            break
        else:
            self._unflock()
            raise RunDirLocked(self._refusal(self.holder()))
        self._since = since
        self._thread = threading.Thread(target=self._beat, name="megamu-run-lock", daemon=True)
        self._thread.start()
        return self

    def _beat(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            h = self.holder()
            if not h or h.get("pid") != self.me["pid"] or h.get("host") != self.me["host"]:
                print(f"[run lock] {self.path} no longer names this run ({h}): heartbeat stopped", flush=True)
                return
            atomic_write_text(self.path, self._record(self._since))

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
            h = self.holder()
            if h and h.get("pid") == self.me["pid"] and h.get("host") == self.me["host"]:
                self.path.unlink(missing_ok=True)
        self._unflock()

    def _unflock(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()
