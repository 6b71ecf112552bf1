"""Score responses in worker processes with a hard per-item timeout.

Why our own pool and not concurrent.futures: a worker stuck in sympy must be killed and replaced, with the item
scored 0, without poisoning the rest of the batch. Workers are fresh interpreters (``python -m megamu.reward.worker``):
no forked torch/OpenMP/lock state and no re-import of the caller's ``__main__`` as multiprocessing's spawn would do.
They announce themselves ready after importing the reward function, so import time never counts against an item.
A worker whose parent dies sees EOF on its pipe and exits.
"""

from __future__ import annotations

import functools
import importlib
import json
import os
import subprocess
import sys
import time
import weakref
from collections import deque
from collections.abc import Callable
from multiprocessing.connection import Connection, wait

DEFAULT_REWARD_FN = "megamu.reward.math:math_score"
READY = "ready"


def load_reward_fn(spec: str) -> Callable[[str, str], float]:
    """Resolve ``"module:function"`` (the --reward-fn flag) to fn(response, ground_truth) -> float."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"--reward-fn must look like 'module:function', got {spec!r}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"--reward-fn {spec!r}: cannot import module {module_name!r}: {e}") from e
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"--reward-fn {spec!r}: {module_name!r} has no callable {attr!r}")
    return fn


def bind_reward_fn(spec: str, fn_kwargs: dict | None = None) -> Callable[[str, str], float]:
    """``load_reward_fn`` with keyword arguments bound (e.g. the code reward's timeout and mode)."""
    fn = load_reward_fn(spec)
    return functools.partial(fn, **fn_kwargs) if fn_kwargs else fn


class _Worker:
    def __init__(self, spec: str, fn_kwargs: dict | None = None):
        to_child_r, to_child_w = os.pipe()
        to_parent_r, to_parent_w = os.pipe()
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "megamu.reward.worker", str(to_child_r), str(to_parent_w), spec,
             json.dumps(fn_kwargs or {})],
            pass_fds=(to_child_r, to_parent_w), stdin=subprocess.DEVNULL, env=env,
        )
        os.close(to_child_r)
        os.close(to_parent_w)
        self.send_conn = Connection(to_child_w, readable=False)
        self.conn = Connection(to_parent_r, writable=False)
        self.ready = False
        self.item: int | None = None
        self.deadline = 0.0

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(5)
        self.send_conn.close()
        self.conn.close()


def _close_workers(workers: list[_Worker]) -> None:
    for w in workers:
        try:
            w.send_conn.send(None)
        except (OSError, ValueError):
            pass
    end = time.monotonic() + 2.0
    for w in workers:
        try:
            w.proc.wait(max(0.0, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
        w.kill()
    workers.clear()


class RewardScorer:
    """A pool of reward workers, created once and reused across batches; ``close()`` (or ``with``) ends them.
    ``fn_kwargs`` (JSON-serialisable) are bound to the reward function in every worker."""

    def __init__(self, reward_fn: str = DEFAULT_REWARD_FN, *, timeout_s: float = 5.0, num_workers: int | None = None,
                 startup_timeout_s: float = 120.0, fn_kwargs: dict | None = None):
        load_reward_fn(reward_fn)  # fail fast, in the parent, with a clear message
        self.spec = reward_fn
        self.fn_kwargs = dict(fn_kwargs or {})
        json.dumps(self.fn_kwargs)  # must reach the workers on their command line
        self.timeout_s = timeout_s
        self.startup_timeout_s = startup_timeout_s
        self.num_workers = num_workers or max(1, min(4, os.cpu_count() or 1))
        self._workers = [_Worker(reward_fn, self.fn_kwargs) for _ in range(self.num_workers)]
        self.num_timeouts = 0
        self.num_crashes = 0
        self._finalizer = weakref.finalize(self, _close_workers, self._workers)

    def __enter__(self) -> RewardScorer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._finalizer()

    def _replace(self, w: _Worker) -> None:
        w.kill()
        self._workers[self._workers.index(w)] = _Worker(self.spec, self.fn_kwargs)

    def score(self, responses: list[str], ground_truths: list[str]) -> list[float]:
        if len(responses) != len(ground_truths):
            raise ValueError(f"{len(responses)} responses but {len(ground_truths)} ground truths")
        if not self._finalizer.alive:
            raise RuntimeError("RewardScorer is closed")
        results: list[float | None] = [None] * len(responses)
        todo = deque(range(len(responses)))
        started = time.monotonic()
        while todo or any(w.item is not None for w in self._workers):
            now = time.monotonic()
            for w in self._workers:
                if w.ready and w.item is None and todo:
                    i = todo.popleft()
                    try:
                        w.send_conn.send((i, responses[i], ground_truths[i]))
                    except (OSError, ValueError):  # died while idle: put the item back, start a new worker
                        todo.appendleft(i)
                        self.num_crashes += 1
                        self._replace(w)
                        continue
                    w.item, w.deadline = i, now + self.timeout_s
            busy = [w for w in self._workers if w.item is not None]
            if not any(w.ready for w in self._workers) and now - started > self.startup_timeout_s:
                raise RuntimeError(f"reward workers for {self.spec!r} did not start within {self.startup_timeout_s}s")
            next_deadline = min((w.deadline for w in busy), default=now + 1.0)
            ready_conns = wait([w.conn for w in self._workers], timeout=max(0.0, min(next_deadline - now, 1.0)))
            for w in list(self._workers):
                if w.conn in ready_conns:
                    self._receive(w, results)
            now = time.monotonic()
            for w in list(self._workers):
                if w.item is not None and now > w.deadline:
                    results[w.item] = 0.0
                    self.num_timeouts += 1
                    self._replace(w)
        return [float(r) for r in results]

    def _receive(self, w: _Worker, results: list[float | None]) -> None:
        try:
            msg = w.conn.recv()
        except (EOFError, OSError):  # the worker crashed (segfault, OOM kill, os._exit in the reward fn)
            if not w.ready:
                raise RuntimeError(f"a reward worker for {self.spec!r} died during startup") from None
            if w.item is not None:
                results[w.item] = 0.0
            self.num_crashes += 1
            self._replace(w)
            return
        if msg == READY:
            w.ready = True
        elif isinstance(msg, tuple) and msg[0] == "error":
            raise RuntimeError(f"reward function {self.spec!r} failed to load in a worker:\n{msg[1]}")
        else:
            i, score = msg
            if i == w.item:
                results[i] = score
                w.item = None


def score_batch(responses: list[str], ground_truths: list[str], timeout_s: float = 5.0,
                num_workers: int | None = None, reward_fn: str = DEFAULT_REWARD_FN) -> list[float]:
    """One-off scoring with a temporary pool; the rollout phase keeps a ``RewardScorer`` instead."""
    with RewardScorer(reward_fn, timeout_s=timeout_s, num_workers=num_workers) as scorer:
        return scorer.score(responses, ground_truths)
