"""Entry point of one reward worker process (started by ``megamu.reward.pool.RewardScorer``)."""

from __future__ import annotations

import json
import signal
import sys
import traceback
from multiprocessing.connection import Connection

from megamu.reward.pool import READY, bind_reward_fn
from megamu.reward.signatures import RowMeta, adapt


def _worker_main(recv_fd: int, send_fd: int, spec: str, fn_kwargs: dict) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent owns shutdown
    inbox, conn = Connection(recv_fd, writable=False), Connection(send_fd, readable=False)
    try:
        fn = adapt(bind_reward_fn(spec, fn_kwargs))
    except Exception:  # noqa: BLE001 - reported to the parent, which raises it
        conn.send(("error", traceback.format_exc()))
        return
    try:  # warm-up: lazy imports (sympy, math-verify) must not count against the first item's timeout
        fn("\\boxed{1}", "2", RowMeta())
    except Exception:  # noqa: BLE001, S110 - a custom fn may reject the dummy input; that is fine
        pass
    conn.send(READY)
    while True:
        try:
            msg = inbox.recv()
        except EOFError:  # the parent is gone
            return
        if msg is None:
            return
        i, response, truth, meta = msg
        try:
            conn.send((i, fn(response, truth, meta), None))
        except Exception as e:  # noqa: BLE001 - the parent counts it and stops the run past the tolerance
            conn.send((i, 0.0, f"{type(e).__name__}: {e}"))


if __name__ == "__main__":
    _worker_main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], json.loads(sys.argv[4]))
