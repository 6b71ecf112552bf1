"""Trainer launches for the tests from a process that has imported the trainer once.

A one-rank run of `pretrain_mu_grpo.py` on the tiny model trains for about 2 s and spends about 6 s importing torch,
megatron-core, torch's compiler (torch.optim's constructors import it) and transformers; the suite launches some thirty
of them. Here a server process (``python -m tests.warm_launch``, one per pytest worker) imports them once and forks one
child per run.
The child is a process of its own, as a launch from scratch is: its own session (killed as a group), the run's
environment, stdout and stderr to files, ``sys.argv`` set and the script run as ``__main__``; it ends as a Python
process ends (atexit handlers, non-daemon threads joined), or abruptly through the crash hook's ``os._exit``.
What it skips is only the imports: every module the run imports after them is imported in the child.

Forking is safe because the server runs nothing after its imports: torch has not started its OpenMP workers (they
start at the first parallel op), no process group exists and no thread has started (checked). Runs with torchrun
keep launching from scratch.

Protocol, one JSON line each way: request {argv, env, cwd, stdout, stderr} -> {"pid"} when forked, {"rc"} when done.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "pretrain_mu_grpo.py"
# What a run imports before it trains (the loop modules are imported in main(), after parsing the flags); megatron-core
# comes first, imported as the run's init_distributed does (megamu.device.Device.import_megatron).
PRELOAD = ("pretrain_mu_grpo", "megamu.loop.run", "megamu.loop.staged", "megamu.loop.async_", "megamu.engines.local",
           "megatron.core.models.gpt", "torch._dynamo", "transformers")
# Modules whose import makes state of the process: wandb makes a media temp folder at import and deletes it at exit,
# so the first child to end would delete it under every later one. A child must import them itself.
NOT_SHARED = ("wandb",)


def _child(req: dict) -> None:
    """The run, in the forked child: never returns to the server's loop (exits like a fresh interpreter would)."""
    import runpy

    os.setsid()
    os.chdir(req["cwd"])
    os.environ.clear()
    os.environ.update(req["env"])
    for fd, path in ((1, req["stdout"]), (2, req["stderr"])):
        out = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(out, fd)
        os.close(out)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)  # the server's request pipe is not the run's stdin
    os.close(null)
    sys.argv = [str(SCRIPT), *req["argv"]]
    sys.path[0] = str(SCRIPT.parent)
    runpy.run_path(str(SCRIPT), run_name="__main__")
    sys.exit(0)  # SystemExit, raised here or by the run, unwinds to the interpreter's own exit


def serve() -> None:
    import importlib
    import threading

    from megamu.device import CPU

    CPU.import_megatron()
    for name in PRELOAD:
        importlib.import_module(name)
    shared = [m for m in NOT_SHARED if m in sys.modules]
    if shared:
        raise SystemExit(f"tests/warm_launch.py: the preloaded modules import {shared}: children would share them")
    if threading.active_count() != 1:  # a fork copies only the calling thread: a child would miss the others
        raise SystemExit(f"tests/warm_launch.py: the preloaded modules started threads: {threading.enumerate()}")
    reply = sys.stdout
    reply.write("ready\n")
    reply.flush()
    for line in sys.stdin:
        req = json.loads(line)
        pid = os.fork()
        if pid == 0:
            _child(req)
        reply.write(json.dumps({"pid": pid}) + "\n")
        reply.flush()
        _, status = os.waitpid(pid, 0)
        reply.write(json.dumps({"rc": os.waitstatus_to_exitcode(status)}) + "\n")
        reply.flush()


class WarmLauncher:
    """The test side: starts the server once, then ``run`` behaves as tests.processes.run_owned on the trainer."""

    def __init__(self, env: dict[str, str]):
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.warm_launch"], cwd=REPO, env=env, bufsize=0,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, start_new_session=True)
        self._pending = b""  # read from the server, not yet a whole line
        if (line := self._readline(time.monotonic() + 300)) != "ready":
            raise RuntimeError(f"the warm-launch server said {line!r}")

    def _readline(self, deadline: float | None) -> str:
        """The server's next line. Read from the pipe itself, not a buffered file: the pid and exit-code lines of a
        short run may arrive together, and a select() on the pipe would not see the second in a file's buffer."""
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._pending:
            wait = None if deadline is None else max(deadline - time.monotonic(), 0.0)
            if not select.select([fd], [], [], wait)[0]:
                raise subprocess.TimeoutExpired("warm launch", wait)
            chunk = os.read(fd, 4096)
            if not chunk:
                raise RuntimeError(f"the warm-launch server exited ({self.proc.wait()})")
            self._pending += chunk
        line, _, self._pending = self._pending.partition(b"\n")
        return line.decode().strip()

    def run(self, args: list[str], *, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
        with tempfile.TemporaryDirectory(prefix="warm-launch-") as tmp:
            out, err = Path(tmp) / "stdout", Path(tmp) / "stderr"
            req = {"argv": args, "env": env, "cwd": str(REPO), "stdout": str(out), "stderr": str(err)}
            self.proc.stdin.write((json.dumps(req) + "\n").encode())
            pid = json.loads(self._readline(time.monotonic() + 60))["pid"]
            try:
                rc = json.loads(self._readline(time.monotonic() + timeout))["rc"]
            except BaseException:  # a timeout, or the test interrupted: the run's whole session goes
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pid, signal.SIGKILL)
                json.loads(self._readline(None))  # the server reaps it before it takes the next run
                raise
            return subprocess.CompletedProcess([sys.executable, str(SCRIPT), *args], rc, out.read_text(),
                                               err.read_text())

    def close(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()


if __name__ == "__main__":
    serve()
