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
from dataclasses import asdict, dataclass
from multiprocessing.connection import Connection, wait

from megamu.reward.signatures import CallOptions, RowMeta, is_async, reward_style

DEFAULT_REWARD_FN = "megamu.reward.routing:data_source_score"  # math_score unless the row says otherwise
READY = "ready"


def load_reward_fn(spec: str) -> Callable[..., float]:
    """Resolve the --reward-fn flag to the function: ``module:function``, ``path/file.py:function`` (verl's
    ``custom_reward_function.path`` + ``.name``) or ``module.function`` (slime's ``--custom-rm-path``)."""
    module_name, sep, attr = spec.partition(":") if ":" in spec else spec.rpartition(".")
    if not sep or not module_name or not attr:
        raise ValueError(f"--reward-fn must look like 'module:function', got {spec!r}")
    try:
        module = _import_file(module_name) if module_name.endswith(".py") else importlib.import_module(module_name)
    except (ImportError, OSError) as e:
        raise ValueError(f"--reward-fn {spec!r}: cannot import module {module_name!r}: {e}") from e
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"--reward-fn {spec!r}: {module_name!r} has no callable {attr!r}")
    return fn


def _import_file(path: str):
    import importlib.util

    spec = importlib.util.spec_from_file_location(os.path.splitext(os.path.basename(path))[0], path)
    if spec is None or spec.loader is None:
        raise ImportError(f"{path} is not a Python file")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def bind_reward_fn(spec: str, fn_kwargs: dict | None = None) -> Callable[[str, str], float]:
    """``load_reward_fn`` with keyword arguments bound (e.g. the code reward's timeout and mode)."""
    fn = load_reward_fn(spec)
    return functools.partial(fn, **fn_kwargs) if fn_kwargs else fn


class RewardFunctionError(RuntimeError):
    """More of a run's reward calls raised than its tolerance allows: the message names the function, the exception
    and one offending sample."""


@dataclass
class RewardFailure:
    """One reward call that raised (or whose worker died): what the error message shows."""

    error: str
    response: str
    ground_truth: str
    meta: RowMeta


class _Worker:
    def __init__(self, spec: str, fn_kwargs: dict | None, options: CallOptions):
        to_child_r, to_child_w = os.pipe()
        to_parent_r, to_parent_w = os.pipe()
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "megamu.reward.worker", str(to_child_r), str(to_parent_w), spec,
             json.dumps(fn_kwargs or {}), json.dumps(asdict(options))],
            pass_fds=(to_child_r, to_parent_w), stdin=subprocess.DEVNULL, env=env,
        )
        os.close(to_child_r)
        os.close(to_parent_w)
        self.send_conn = Connection(to_child_w, readable=False)
        self.conn = Connection(to_parent_r, writable=False)
        self.ready = False
        self.units: dict[int, float] = {}  # units in flight -> their deadline

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


def default_num_workers() -> int:
    """Reward worker processes when --reward-workers is not given: one per core, at most 4."""
    return max(1, min(4, os.cpu_count() or 1))


class RewardScorer:
    """A pool of reward workers, created once and reused across batches; ``close()`` (or ``with``) ends them.
    ``fn_kwargs`` (JSON-serialisable) are bound to the reward function in every worker; ``options`` say how it is
    called (signatures.CallOptions: --reward-key, slime's args, --group-rm, async concurrency, warm-up).

    A call that raises scores 0 and is counted (``num_errors``, with ``first_failure``). A call that runs past
    ``timeout_s`` scores 0, its worker is replaced, and it is counted in ``num_timeouts``; with
    ``timeouts_are_errors`` (a user's function: a judge that hangs) it also counts against the tolerance, while for
    megamu's own scorers a timeout is the reply's fault (math-verify sent into a long search by it) and is only
    counted. Once more than ``max_error_fraction`` of the items scored so far failed, ``score`` raises
    ``RewardFunctionError`` instead of returning (None: count only)."""

    def __init__(self, reward_fn: str = DEFAULT_REWARD_FN, *, timeout_s: float = 5.0, num_workers: int | None = None,
                 startup_timeout_s: float = 120.0, fn_kwargs: dict | None = None,
                 max_error_fraction: float | None = None, options: CallOptions | None = None,
                 timeouts_are_errors: bool = True):
        fn = load_reward_fn(reward_fn)
        self.style = reward_style(fn)  # fail fast, in the parent, with a clear message
        self.options = options or CallOptions()
        if self.options.group and self.style != "slime":
            raise ValueError(f"--group-rm: {reward_fn!r} has the {self.style} signature; a group reward is slime's "
                             "custom_rm(args, samples) returning one reward per sample")
        if self.options.concurrency > 1 and not is_async(fn):
            raise ValueError(f"--reward-concurrency {self.options.concurrency}: {reward_fn!r} is not async (calls "
                             "of a plain function run one per worker: raise --reward-workers instead)")
        self.max_error_fraction = max_error_fraction
        self.timeouts_are_errors = timeouts_are_errors
        self.num_scored = 0
        self.num_errors = 0
        self.num_failed = 0  # errors, and timeouts where they count: what the tolerance bounds
        self.first_failure: RewardFailure | None = None
        self.spec = reward_fn
        self.fn_kwargs = dict(fn_kwargs or {})
        json.dumps(self.fn_kwargs)  # must reach the workers on their command line
        self.timeout_s = timeout_s
        self.startup_timeout_s = startup_timeout_s
        self.num_workers = num_workers or default_num_workers()
        self._workers = [self._new_worker() for _ in range(self.num_workers)]
        self.num_timeouts = 0
        self.num_crashes = 0
        self._finalizer = weakref.finalize(self, _close_workers, self._workers)

    def _new_worker(self) -> _Worker:
        return _Worker(self.spec, self.fn_kwargs, self.options)

    def __enter__(self) -> RewardScorer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._finalizer()

    def _replace(self, w: _Worker, todo: deque) -> None:
        """A new worker in ``w``'s place; the units it still had in flight go back to the queue."""
        todo.extendleft(sorted(w.units, reverse=True))
        w.units.clear()
        w.kill()
        self._workers[self._workers.index(w)] = self._new_worker()

    def score(self, responses: list[str], ground_truths: list[str], metas: list[RowMeta] | None = None, *,
              group_size: int = 1) -> list[float]:
        """One score per response; ``metas``: each item's row (data_source, extra_info) and sample (for slime's
        Sample). With --group-rm each run of ``group_size`` consecutive items is one call (a prompt group)."""
        if len(responses) != len(ground_truths):
            raise ValueError(f"{len(responses)} responses but {len(ground_truths)} ground truths")
        metas = metas or [RowMeta() for _ in responses]
        size = group_size if self.options.group else 1
        if len(responses) % size:
            raise ValueError(f"{len(responses)} responses are not whole groups of {size}")
        self._batch = (responses, ground_truths, metas)
        self._units = [range(u * size, (u + 1) * size) for u in range(len(responses) // size)]
        if not self._finalizer.alive:
            raise RuntimeError("RewardScorer is closed")
        results: list[float | None] = [None] * len(responses)
        todo = deque(range(len(self._units)))
        started = time.monotonic()
        while todo or any(w.units for w in self._workers):
            now = time.monotonic()
            for w in list(self._workers):
                while w.ready and len(w.units) < self.options.concurrency and todo:
                    u = todo.popleft()
                    try:
                        w.send_conn.send((u, [(responses[i], ground_truths[i], metas[i]) for i in self._units[u]]))
                    except (OSError, ValueError):  # died while idle: put the unit back, start a new worker
                        todo.appendleft(u)
                        self.num_crashes += 1
                        self._replace(w, todo)
                        break
                    w.units[u] = now + self.timeout_s
            if not any(w.ready for w in self._workers) and now - started > self.startup_timeout_s:
                raise RuntimeError(f"reward workers for {self.spec!r} did not start within {self.startup_timeout_s}s")
            next_deadline = min((d for w in self._workers for d in w.units.values()), default=now + 1.0)
            ready_conns = wait([w.conn for w in self._workers], timeout=max(0.0, min(next_deadline - now, 1.0)))
            for w in list(self._workers):
                if w.conn in ready_conns:
                    self._receive(w, results, todo)
            now = time.monotonic()
            for w in list(self._workers):
                late = [u for u, deadline in w.units.items() if now > deadline]
                for u in late:  # the unit fails; the worker (stuck in it) is replaced, its other units retried
                    del w.units[u]
                    self._fail(u, f"timed out after {self.timeout_s:g} s (--reward-timeout)", results, timeout=True)
                if late:
                    self._replace(w, todo)
        self.num_scored += len(responses)
        self._check_errors()
        return [float(r) for r in results]

    def _fail(self, u: int, error: str, results: list[float | None], *, timeout: bool = False) -> None:
        """Unit ``u``'s items score 0 and are counted: as errors, or as timeouts (failures when those count)."""
        n = len(self._units[u])
        for i in self._units[u]:
            results[i] = 0.0
        if timeout:
            self.num_timeouts += n
            if not self.timeouts_are_errors:
                return
        else:
            self.num_errors += n
        self.num_failed += n
        if self.first_failure is None:
            responses, truths, metas = self._batch
            i = self._units[u][0]
            self.first_failure = RewardFailure(error, responses[i], truths[i], metas[i])

    def _check_errors(self) -> None:
        limit, failed = self.max_error_fraction, self.num_failed
        if limit is None or failed <= limit * self.num_scored:
            return
        f = self.first_failure
        raise RewardFunctionError(
            f"reward function {self.spec!r} ({self.style} signature) failed on {failed} of "
            f"{self.num_scored} samples ({self.num_errors} raised, "
            f"{failed - self.num_errors} timed out after {self.timeout_s:g} s, --reward-timeout), more than the "
            f"tolerated fraction {limit} (--reward-error-tolerance): "
            f"{f.error}\n  one offending sample: ground truth {f.ground_truth!r}, data_source {f.meta.data_source!r}, "
            f"response {f.response[:300]!r}")

    def _receive(self, w: _Worker, results: list[float | None], todo: deque) -> None:
        try:
            msg = w.conn.recv()
        except (EOFError, OSError):  # the worker crashed (segfault, OOM kill, os._exit in the reward fn)
            if not w.ready:
                raise RuntimeError(f"a reward worker for {self.spec!r} died during startup") from None
            for u in list(w.units):  # which of its units crashed it is unknown: all of them fail
                del w.units[u]
                self._fail(u, f"the worker died (exit code {w.proc.poll()}) while scoring", results)
            self.num_crashes += 1
            self._replace(w, todo)
            return
        if msg == READY:
            w.ready = True
        elif isinstance(msg, tuple) and msg[0] == "error":
            raise RuntimeError(f"reward function {self.spec!r} failed to load in a worker:\n{msg[1]}")
        else:
            u, scores, error = msg
            if u in w.units:
                del w.units[u]
                if error is None:
                    for i, score in zip(self._units[u], scores):
                        results[i] = score
                else:
                    self._fail(u, error, results)


def score_batch(responses: list[str], ground_truths: list[str], timeout_s: float = 5.0,
                num_workers: int | None = None, reward_fn: str = DEFAULT_REWARD_FN) -> list[float]:
    """One-off scoring with a temporary pool; the rollout phase keeps a ``RewardScorer`` instead."""
    with RewardScorer(reward_fn, timeout_s=timeout_s, num_workers=num_workers) as scorer:
        return scorer.score(responses, ground_truths)
