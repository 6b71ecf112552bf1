"""Entry point of one reward worker process (started by ``megamu.reward.pool.RewardScorer``).

Messages in: ``(unit, items)`` (items: (response, ground truth, RowMeta) tuples, one prompt group with --group-rm,
else one), or None to stop. Out: ``READY`` once, then ``(unit, scores, None)`` or ``(unit, None, error)`` per unit.
An async function serves up to ``concurrency`` units at once on one event loop (slime runs its coroutines the same
way, one loop per process, many requests in flight: slime/rollout/rm_hub ``async_rm``).
"""

from __future__ import annotations

import asyncio
import inspect
import json
import signal
import sys
import traceback
from multiprocessing.connection import Connection

from megamu.reward.pool import READY, bind_reward_fn
from megamu.reward.signatures import CallOptions, RowMeta, adapt, is_async

WARM_UP_ITEM = ("\\boxed{1}", "2", RowMeta())


def _error(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


def _serve_sync(inbox: Connection, conn: Connection, call) -> None:
    while True:
        try:
            msg = inbox.recv()
        except EOFError:  # the parent is gone
            return
        if msg is None:
            return
        unit, items = msg
        try:
            result = call(items)
            if inspect.isawaitable(result):
                result = asyncio.run(_await(result))
            conn.send((unit, result, None))
        except Exception as e:  # noqa: BLE001 - the parent counts it and stops the run past the tolerance
            conn.send((unit, None, _error(e)))


async def _await(value):
    return await value


async def _serve_async(inbox: Connection, conn: Connection, call, concurrency: int) -> None:
    loop = asyncio.get_running_loop()
    slots = asyncio.Semaphore(concurrency)  # the parent sends at most this many; a bound all the same
    running: set[asyncio.Task] = set()

    async def one(unit: int, items: list) -> None:
        async with slots:
            try:
                conn.send((unit, await call(items), None))
            except Exception as e:  # noqa: BLE001 - counted by the parent
                conn.send((unit, None, _error(e)))

    while True:
        try:
            msg = await loop.run_in_executor(None, inbox.recv)  # the pipe is read off the loop's thread
        except EOFError:
            return
        if msg is None:
            return
        task = asyncio.create_task(one(*msg))
        running.add(task)
        task.add_done_callback(running.discard)


def _worker_main(recv_fd: int, send_fd: int, spec: str, fn_kwargs: dict, options: CallOptions) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent owns shutdown
    inbox, conn = Connection(recv_fd, writable=False), Connection(send_fd, readable=False)
    try:
        fn = bind_reward_fn(spec, fn_kwargs)
        call = adapt(fn, options)
    except Exception:  # noqa: BLE001 - reported to the parent, which raises it
        conn.send(("error", traceback.format_exc()))
        return
    if options.warm_up:  # megamu's own scorers: lazy imports (sympy, math-verify) must not count against an item
        try:
            result = call([WARM_UP_ITEM])
            if inspect.isawaitable(result):
                asyncio.run(_await(result))
        except Exception:  # noqa: BLE001, S110 - the dummy item may be rejected; that is fine
            pass
    conn.send(READY)
    if is_async(fn):
        asyncio.run(_serve_async(inbox, conn, call, options.concurrency))
    else:
        _serve_sync(inbox, conn, call)


if __name__ == "__main__":
    _worker_main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], json.loads(sys.argv[4]),
                 CallOptions(**json.loads(sys.argv[5])))
