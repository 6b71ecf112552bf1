"""Health of the SGLang servers: waiting for them at start, probing them while they generate, moving a dead server's
requests to the live ones, and restarting the servers megamu launched.

While requests are out, every server is probed each ``probe_period_s`` with ``/health_generate`` (SGLang runs a
one-token generation, and answers at once when the server is already producing tokens), as slime's
RolloutHealthMonitor does under ``--use-fault-tolerance`` (slime/utils/health_monitor.py). Unlike slime, where one
failed check kills the engine (users report every engine marked dead under load), a server is dead only when
- its process exited (servers megamu launched),
- its port refuses connections, or
- it missed ``probe_misses`` probes in a row (no answer within ``probe_timeout_s``, or a 5xx): a hung server
  (SIGSTOP, a deadlocked scheduler) is found within probe_misses * (probe_period_s + probe_timeout_s), not after a
  request's hour-long timeout.
Probes pause while nothing is out, as slime pauses its monitor while the engines are offloaded: an idle or released
colocated server is not generating and must not be judged on it.

A dead server's requests are cancelled and go back through the dispatcher to the live servers with the same body (the
same sampling seeds and sample indices; fresh request ids only), so each group is the one a fault-free run draws (on
deterministic servers) and is written once: a request's future completes once, whichever server answered it. A
server megamu launched is restarted from the same folder, its weights pushed again when they were synced from a
folder since, at most ``max_restarts`` times per stage, and rejoins once it answers /health (slime restarts its
engines the same way, slime/ray/rollout.py). When restarts run out, or no server is left, every request fails with
an error naming the server, its exit status and its log tail; the shards written so far stay, and a rerun resumes at
the first missing one.
"""

from __future__ import annotations

import asyncio
import http.client
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from megamu.engines.sglang.dispatch import Dispatcher
from megamu.engines.sglang.launch import log_tail, startup_timeout, stop_processes
from megamu.engines.sglang.pool import ServerPool
from megamu.engines.sglang.schema import SGLangError
from megamu.engines.sglang.transport import AsyncTransport, HTTPRefused, Unreachable, attempt_body
from megamu.engines.sglang.weight_sync import WeightSync

PROGRESS_EVERY_S = 10.0  # a line naming the servers still awaited at start


def wait_for_servers(call, urls: list[str], procs: list, logs: list[Path], timeout_s: float,
                     given: bool) -> list[int]:
    """Indices of the servers that answer /health within ``timeout_s``, printing every PROGRESS_EVERY_S which are
    still awaited. Launched servers (``given`` False) must all answer, and one that exits fails at once; of given
    servers, the run starts on those that answer and names the others. None answering: SGLangError naming each URL
    with its error (and log tail). ``call(url, path, body, timeout)`` is the pool's control call."""
    t0 = time.monotonic()
    pending, errors, next_line = list(range(len(urls))), {}, t0 + PROGRESS_EVERY_S
    describe = lambda i: f"{urls[i]} ({errors.get(i, 'no answer')})" + (
        f"; log {logs[i]}:\n{log_tail(logs[i])}" if i < len(logs) else "")
    while pending:
        for i in list(pending):
            proc = procs[i] if i < len(procs) else None
            if proc is not None and proc.poll() is not None:
                raise SGLangError(f"SGLang server {urls[i]} exited with code {proc.returncode} during startup; "
                                  f"log {logs[i]}:\n{log_tail(logs[i])}")
            try:
                call(urls[i], "/health", None, 5.0)
                pending.remove(i)
            except (OSError, http.client.HTTPException, SGLangError) as e:
                errors[i] = f"{type(e).__name__}: {e}"
        waited = time.monotonic() - t0
        if not pending or waited > timeout_s:
            break
        if time.monotonic() >= next_line:
            print(f"[sglang] waited {waited:.0f}s of {timeout_s:.0f}s for {len(pending)} of {len(urls)} server(s): "
                  + ", ".join(urls[i] for i in pending), flush=True)
            next_line += PROGRESS_EVERY_S
        time.sleep(0.5)
    ready = [i for i in range(len(urls)) if i not in pending]
    if pending and given and ready:
        print(f"[sglang] starting on {len(ready)} of {len(urls)} servers; no answer after {timeout_s:.0f}s from "
              + "; ".join(describe(i) for i in pending), flush=True)
    elif pending:
        raise SGLangError(f"SGLang server(s) not healthy after {timeout_s:.0f}s:\n  "
                          + "\n  ".join(describe(i) for i in pending))
    return ready


def _exit_status(proc: subprocess.Popen, timeout: float) -> int | None:
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        return None


@dataclass
class ServerState:
    url: str
    index: int  # its place on its node: port_base + index, for the servers megamu launched
    proc: subprocess.Popen | None = None  # None: a server megamu did not start (it is never restarted)
    log: Path | None = None
    alive: bool = True
    restarting: bool = False
    misses: int = 0  # probes in a row without an answer
    restarts: int = 0  # this stage
    requests: int = 0  # answered this stage
    samples: int = 0
    inflight: set = field(default_factory=set)  # the asyncio tasks of its requests now


class WeightRestorer(Protocol):
    """The weights a server back from a restart must serve: those of the engine's last sync (weight_sync.py)."""

    def restorable(self) -> bool:
        """Whether they can be given to a restarted server (else it is not restarted)."""

    def restore(self, url: str) -> None:
        """Give them to server ``url`` when it serves other weights; raises when it cannot."""


class Supervisor:
    """Sends each request to a live server and watches them all; lives on the transport's event loop.

    It launches again the dead servers of ``pool`` that megamu launched, marks ``sync``'s group stale when a server
    dies, and gives a restarted or rejoining server the last sync's weights through ``weights``."""

    def __init__(self, pool: ServerPool, sync: WeightSync, weights: WeightRestorer, servers: list[ServerState],
                 dispatcher: Dispatcher, transport: AsyncTransport):
        self.pool, self.sync, self.weights, self.cfg = pool, sync, weights, pool.config
        self.servers, self.dispatcher, self.transport = servers, dispatcher, transport
        self.fatal: SGLangError | None = None
        # A node's own engine on another rank than the dispatcher's (nodes.py): nothing is sent through it, so it
        # probes all the time and restarts its servers; the dispatcher sees them dead, then rejoining.
        self.keeper = False
        self.events: list[dict] = []  # deaths and restarts, with wall-clock times (the tests measure detection)
        self.t_begin = time.monotonic()
        self._restarter = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sglang-restart")
        self._launch_lock, self._closing = threading.Lock(), False  # no restart launches once the engine stops
        self.paused = False  # no probe starts (``pause_probes``)
        self._probing: asyncio.Future | None = None  # the round of probes in flight
        self._watcher = transport.submit(self._watch())

    def begin_stage(self) -> None:
        """A stage starts: its restart budget and request counts start from zero."""
        self.t_begin = time.monotonic()
        for s in self.servers:
            s.restarts = s.requests = s.samples = 0

    def stats(self) -> list[dict]:
        """Per server since ``begin_stage``: requests and samples answered, samples/s, restarts."""
        dt = max(time.monotonic() - self.t_begin, 1e-9)
        return [{"url": s.url, "requests": s.requests, "samples": s.samples, "samples_per_s": round(s.samples / dt, 3),
                 "restarts": s.restarts, "alive": s.alive} for s in self.servers]

    def close(self) -> None:
        """Stop watching; a restart under way launches nothing more (the engine then stops what was launched)."""
        with self._launch_lock:
            self._closing = True
        self._watcher.cancel()
        self._restarter.shutdown(wait=False, cancel_futures=True)

    # ---- requests ---------------------------------------------------------------------------------------------
    async def request(self, path: str, body: dict, n: int, what: str):
        """POST ``body`` (``n`` sequences) to a live server; retried elsewhere when its server dies. Connection
        errors of a server that still answers its probe are retried with backoff, at most ``max_retries`` times; a
        refusal (4xx) or a timeout is never retried."""
        cfg = self.cfg
        delay, errors, attempt, failed = cfg.backoff_s, 0, 0, None
        while True:
            server = await self.dispatcher.acquire(n, avoid=failed)
            st = self.servers[server]
            task = asyncio.ensure_future(self.transport.post(st.url, path, attempt_body(body, attempt),
                                                             timeout=cfg.request_timeout_s))
            st.inflight.add(task)
            error = None
            try:
                out = await task
            except asyncio.CancelledError:
                if not task.cancelled() or asyncio.current_task().cancelling():
                    raise  # cancelled by the caller, not taken back from a dead server
                out = None
            except HTTPRefused as e:
                raise SGLangError(f"{what}: refused: {e}", status=e.status) from e
            except TimeoutError as e:
                raise SGLangError(f"{what}: no answer from {st.url} within {cfg.request_timeout_s}s") from e
            except (ConnectionError, OSError) as e:
                error = e
            finally:
                st.inflight.discard(task)
                self.dispatcher.release(server, n)
            attempt += 1  # a new attempt needs new request ids
            if task.cancelled():
                continue  # its server is dead: the same seeds and sample indices go to a live one
            if error is None:
                st.requests += 1
                st.samples += n
                return out
            await self._probe(server)  # a dropped connection: is the server gone? then it costs no retry
            if not st.alive:
                continue
            errors, failed = errors + 1, server  # the retry goes to another server, when there is one
            if errors > cfg.max_retries:
                raise SGLangError(f"{what}: failed after {errors} attempts: {error}") from error
            await asyncio.sleep(delay)
            delay *= 2

    # ---- probes -----------------------------------------------------------------------------------------------
    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.probe_period_s)
            if self.fatal is None and not self.paused and (self.dispatcher.busy or self.keeper):
                self._probing = asyncio.gather(*(self._probe(i) if s.alive else self._rejoin(i)
                                                 for i, s in enumerate(self.servers) if not s.restarting),
                                               return_exceptions=True)
                outcomes = await self._probing
                for e in outcomes:  # a bug in a probe must not end the watching unnoticed
                    if isinstance(e, Exception):
                        print(f"[sglang] health probe failed: {type(e).__name__}: {e}", flush=True)

    def pause_probes(self, timeout_s: float) -> None:
        """No probe starts from now on, and the round in flight is waited out (from a thread other than the loop's):
        SGLang's /release_memory_occupation asserts an idle server (weight_updater.py), and /health_generate enqueues
        a real one-token request (http_server.py), so a late probe could trip the assert."""
        self.paused = True

        async def drained() -> None:
            if self._probing is not None:
                await asyncio.wait([self._probing])

        self.transport.submit(drained()).result(timeout=timeout_s)

    def resume_probes(self) -> None:
        self.paused = False

    async def _rejoin(self, i: int) -> None:
        """A dead server megamu did not start here (another node's, restarted by its own node) takes requests again
        once it answers its probe."""
        st = self.servers[i]
        if st.proc is not None:
            return
        try:
            status = await self.transport.get(st.url, "/health_generate", timeout=self.cfg.probe_timeout_s)
        except (TimeoutError, ConnectionError, OSError):
            return
        if status >= 500 or st.alive or self.fatal is not None:
            return
        try:  # restarted from its launch folder, it may hold older weights than this engine pushed since
            await asyncio.get_running_loop().run_in_executor(None, self.weights.restore, st.url)
        except (SGLangError, OSError, http.client.HTTPException, ValueError) as e:
            print(f"[sglang] server {st.url} answers again but cannot take requests: {e}", flush=True)
            return
        st.alive = True
        self.events.append({"event": "rejoined", "url": st.url, "time": time.time()})
        print(f"[sglang] server {st.url} answers again: it takes requests again", flush=True)
        self.dispatcher.set_alive(i, True)

    async def _probe(self, i: int) -> None:
        st = self.servers[i]
        if not st.alive:
            return
        if st.proc is not None and st.proc.poll() is not None:
            return self._dead(i, f"its process exited with status {st.proc.returncode}")
        try:
            status = await self.transport.get(st.url, "/health_generate", timeout=self.cfg.probe_timeout_s)
            miss = f"HTTP {status}" if status >= 500 else None  # a 4xx is an answer (e.g. a router without it)
        except Unreachable as e:
            if st.proc is not None:  # a killed server's port closes just before its exit is seen: wait for it
                await asyncio.get_running_loop().run_in_executor(None, _exit_status, st.proc, 1.0)
                if st.proc.poll() is not None:
                    return self._dead(i, f"its process exited with status {st.proc.returncode}")
            return self._dead(i, f"it refuses connections ({e})")
        except (TimeoutError, ConnectionError, OSError) as e:
            miss = str(e) or type(e).__name__
        if not st.alive:
            return
        st.misses = st.misses + 1 if miss else 0
        if st.misses >= self.cfg.probe_misses:
            self._dead(i, f"it missed {st.misses} health probes in a row (last: {miss})", may_still_run=True)

    def _dead(self, i: int, why: str, may_still_run: bool = False) -> None:
        st = self.servers[i]
        if not st.alive:
            return
        st.alive, st.misses = False, 0
        self.sync.lost_server()  # its side of an in-memory sync group is gone, or will be after a restart
        self.dispatcher.set_alive(i, False)
        moved = list(st.inflight)
        for task in moved:
            task.cancel()
        self.events.append({"event": "dead", "url": st.url, "why": why, "time": time.time(), "moved": len(moved)})
        print(f"[sglang] server {st.url} is dead: {why}; its {len(moved)} request(s) in flight go to the live "
              "servers", flush=True)
        # Not ours to kill, and maybe only slow: it drops what it still runs. A port that refuses has nothing running
        # behind it; an abort sent there could only reach a server that came back on that port since, and rejoined.
        if st.proc is None and moved and may_still_run:
            # started after the "dead" event is recorded: a fast answer would otherwise log "aborted" before it
            threading.Thread(target=self._abort, args=(st.url,), daemon=True).start()
        if self.fatal is not None:
            return
        if st.proc is not None and self.weights.restorable() and st.restarts < self.cfg.max_restarts:
            st.restarting = True
            st.restarts += 1
            future = asyncio.get_running_loop().run_in_executor(self._restarter, self._restart, i)
            future.add_done_callback(lambda f, i=i: self._restarted(i, f))
        elif st.proc is not None and st.restarts >= self.cfg.max_restarts:
            self._fail(f"SGLang server {st.url} is dead ({why}), and it was restarted {st.restarts} time(s) this "
                       f"stage already, the limit (max_restarts)", st)
        elif not any(s.alive or s.restarting for s in self.servers):
            self._fail(f"no SGLang server is left: the last, {st.url}, is dead ({why})", st)

    def _fail(self, message: str, st: ServerState) -> None:
        status = _exit_status(st.proc, 1.0) if st.proc is not None else None
        state = (f"exit status {status}" if status is not None else
                 "still running but not answering" if st.proc is not None else "not started by megamu")
        tail = f"; log {st.log}:\n{log_tail(st.log)}" if st.log else ""
        self.fatal = SGLangError(f"{message}; {state}{tail}")
        print(f"[sglang] {self.fatal}", flush=True)  # a node's keeper has no caller to raise to: say it here
        self.dispatcher.fail(self.fatal)
        for s in self.servers:
            for task in list(s.inflight):
                task.cancel()

    def _abort(self, url: str) -> None:
        """Best effort: a server declared dead that still runs its requests (moved elsewhere) stops them, so a slow
        server is not kept busier with work whose answers nobody reads (SGLang's /abort_request, abort_all)."""
        try:
            self.pool.call(url, "/abort_request", {"abort_all": True}, timeout=self.cfg.probe_timeout_s)
            self.events.append({"event": "aborted", "url": url, "time": time.time()})
        except (SGLangError, OSError, http.client.HTTPException, ValueError):
            pass  # dead indeed, or hung: nothing to stop, or nothing that listens

    # ---- restarts ---------------------------------------------------------------------------------------------
    def _restart(self, i: int) -> float:
        """Stop what is left of server ``i``, start it again, wait for /health, restore the weights; seconds."""
        t0, st = time.monotonic(), self.servers[i]
        stop_processes([st.proc], grace_s=0.0)  # SIGKILL the group: a stopped (hung) server ignores SIGTERM
        with self._launch_lock:
            if self._closing:
                raise SGLangError("the engine is shutting down")
            st.proc, st.log = self.pool.relaunch(st.index, restart=st.restarts)
        wait_for_servers(self.pool.call, [st.url], [st.proc], [st.log], startup_timeout(self.cfg, self.pool.hf_dir),
                         given=False)
        self.weights.restore(st.url)  # samples of other weights than the last sync's would be refused
        return time.monotonic() - t0

    def _restarted(self, i: int, future) -> None:
        st = self.servers[i]
        st.restarting = False
        try:
            seconds = future.result()
        except Exception as e:  # noqa: BLE001 - any failure to restart ends the phase with its message
            if self.fatal is None:
                self._fail(f"SGLang server {st.url} could not be restarted: {e}", st)
            return
        self.events.append({"event": "restarted", "url": st.url, "seconds": seconds, "time": time.time()})
        print(f"[sglang] server {st.url} restarted in {seconds:.1f}s (restart {st.restarts} of at most "
              f"{self.cfg.max_restarts} this stage); it takes requests again", flush=True)
        if self.fatal is None:
            st.alive = True
            self.dispatcher.set_alive(i, True)
