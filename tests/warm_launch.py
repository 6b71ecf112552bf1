"""Trainer (and worker-script) launches for the tests from a process that has imported the trainer once.

A one-rank run of `pretrain_mu_grpo.py` on the tiny model trains for about 2 s and spends about 6 s importing torch,
megatron-core, torch's compiler (torch.optim's constructors import it) and transformers; the suite launches some thirty
of them. Here a server process (``python -m tests.warm_launch``, one per pytest worker) imports them once and forks one
child per run.
The child is a process of its own, as a launch from scratch is: its own session (killed as a group), the run's
environment, stdout and stderr to files, ``sys.argv`` set and the script run as ``__main__``; it ends as a Python
process ends (atexit handlers, non-daemon threads joined), or abruptly through the crash hook's ``os._exit``.
What it skips is only the imports: every module the run imports after them is imported in the child.

Forking is safe because the server runs nothing after its imports: torch has not started its OpenMP workers (they
start at the first parallel op), no process group exists and no thread has started (checked).

A world of N ranks on one node is N children with the environment torchrun gives its workers (RANK, LOCAL_RANK,
WORLD_SIZE, MASTER_ADDR/PORT, ...; rank 0 hosts the rendezvous store, as under a plain env:// init), stopped as
torchrun's agent stops them: when one rank fails, the others get SIGTERM, then SIGKILL after STOP_GRACE_S. The
output is the ranks' stdout (and stderr) one after the other. Tests of the agent itself (a rank's death ending the
job) and multi-node worlds launch torchrun.

Protocol, one JSON line each way: request {script, argv, cwd, ranks: [{env, stdout, stderr}]} -> {"pids"} when
forked, {"rc"} when every rank has ended (the first failing rank's exit code, else 0).
"""

from __future__ import annotations

import atexit
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
STOP_GRACE_S = 5.0  # a failed world's other ranks: SIGTERM, then SIGKILL after this long
# What a run imports before it trains (the loop modules are imported in main(), after parsing the flags); megatron-core
# comes first, imported as the run's init_distributed does (megamu.runtime.device.Device.import_megatron).
PRELOAD = ("pretrain_mu_grpo", "megamu.loop.trainer", "megamu.loop.staged", "megamu.loop.async_",
           "megamu.engines.local", "megatron.core.models.gpt", "torch._dynamo", "transformers")
# Modules whose import makes state of the process: wandb makes a media temp folder at import and deletes it at exit,
# so the first child to end would delete it under every later one. A child must import them itself.
NOT_SHARED = ("wandb",)


def _child(req: dict, rank: dict) -> None:
    """One rank, in the forked child: never returns to the server's loop (exits like a fresh interpreter would)."""
    import runpy

    os.setsid()
    os.chdir(req["cwd"])
    os.environ.clear()
    os.environ.update(rank["env"])
    for fd, path in ((1, rank["stdout"]), (2, rank["stderr"])):
        out = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(out, fd)
        os.close(out)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)  # the server's request pipe is not the run's stdin
    os.close(null)
    script = Path(req["script"])
    sys.argv = [str(script), *req["argv"]]
    sys.path[0] = str(script.parent)
    runpy.run_path(str(script), run_name="__main__")
    sys.exit(0)  # SystemExit, raised here or by the run, unwinds to the interpreter's own exit


def _signal_all(pids: list[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, sig)


def _wait_world(pids: list[int]) -> int:
    """Reap every rank; after the first failure stop the others as torchrun's agent does. The first failure's code."""
    codes: dict[int, int] = {}
    first_failure, stopped_at, killed = 0, None, False
    while len(codes) < len(pids):
        pid, status = os.waitpid(-1, 0 if stopped_at is None else os.WNOHANG)  # the server has no other children
        if pid == 0:  # stopping: the others have not ended yet
            if not killed and time.monotonic() - stopped_at > STOP_GRACE_S:
                _signal_all([p for p in pids if p not in codes], signal.SIGKILL)
                killed = True
            time.sleep(0.05)
            continue
        codes[pid] = os.waitstatus_to_exitcode(status)
        if codes[pid] != 0 and stopped_at is None:
            first_failure, stopped_at = codes[pid], time.monotonic()
            _signal_all([p for p in pids if p not in codes], signal.SIGTERM)
    return first_failure


def serve() -> None:
    import importlib
    import threading

    from megamu.runtime.device import CPU

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
        pids = []
        for rank in req["ranks"]:
            pid = os.fork()
            if pid == 0:
                _child(req, rank)
            pids.append(pid)
        reply.write(json.dumps({"pids": pids}) + "\n")
        reply.flush()
        reply.write(json.dumps({"rc": _wait_world(pids)}) + "\n")
        reply.flush()


def torchrun_env(rank: int, nproc: int, master_port: int) -> dict[str, str]:
    """What torchrun --nproc_per_node ``nproc`` on one node sets for worker ``rank`` (torch 2.13, torch/distributed/
    elastic/agent/server/local_elastic_agent.py:415-430 and _set_local_rank_env), less the TORCHELASTIC_* values of
    the agent's store and restarts: rank 0 hosts the store, as a plain env:// init does."""
    values = {"RANK": rank, "LOCAL_RANK": rank, "WORLD_SIZE": nproc, "LOCAL_WORLD_SIZE": nproc, "GROUP_RANK": 0,
              "GROUP_WORLD_SIZE": 1, "ROLE_RANK": rank, "ROLE_WORLD_SIZE": nproc, "ROLE_NAME": "default",
              "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": master_port}
    return {k: str(v) for k, v in values.items()}


class WarmLauncher:
    """The test side: starts the server once, then ``run`` behaves as tests.processes.run_owned on the trainer (or
    on a worker script), one rank or a world of ``nproc``."""

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

    def run(self, args: list[str], *, env: dict[str, str], timeout: float, nproc: int = 1,
            script: Path = SCRIPT) -> subprocess.CompletedProcess:
        from tests.ports import server_ports

        port = server_ports() if nproc > 1 else 0  # the rendezvous store's: below the ephemeral range
        with tempfile.TemporaryDirectory(prefix="warm-launch-") as tmp:
            ranks = [{"env": env if nproc == 1 else {**env, **torchrun_env(r, nproc, port)},
                      "stdout": str(Path(tmp) / f"stdout{r}"), "stderr": str(Path(tmp) / f"stderr{r}")}
                     for r in range(nproc)]
            req = {"script": str(script), "argv": [str(a) for a in args], "cwd": str(REPO), "ranks": ranks}
            self.proc.stdin.write((json.dumps(req) + "\n").encode())
            pids = json.loads(self._readline(time.monotonic() + 60))["pids"]
            try:
                rc = json.loads(self._readline(time.monotonic() + timeout))["rc"]
            except BaseException:  # a timeout, or the test interrupted: every rank's whole session goes
                _signal_all(pids, signal.SIGKILL)
                json.loads(self._readline(None))  # the server reaps them before it takes the next run
                raise
            out, err = ("".join(Path(r[k]).read_text() for r in ranks) for k in ("stdout", "stderr"))
            return subprocess.CompletedProcess([sys.executable, str(script), *req["argv"]], rc, out, err)

    def close(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()


_launcher: WarmLauncher | None = None


def warm_launcher() -> WarmLauncher:
    """This pytest worker's launcher, started at its first use and stopped at the worker's exit."""
    global _launcher
    if _launcher is None:
        _launcher = WarmLauncher(dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1"))
        atexit.register(_launcher.close)
    return _launcher


if __name__ == "__main__":
    serve()
