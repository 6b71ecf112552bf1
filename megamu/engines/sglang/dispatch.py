"""Which server takes the next /generate request, and how many sequences each server is sent at once.

A server's capacity is counted in sequences (a request of n samples holds n), as SGLang's scheduler counts its
running batch against ``max_running_requests``; each server is sent ``OVERSUBSCRIPTION`` times that, so its decode
batch stays full. Requests go to the server with the fewest outstanding sequences among those with room; the others wait
here, first come first served, so requests start in the order the rollout phase submitted them (shard order).
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from typing import Any

# Sequences in flight per server when neither the flag nor the server says: slime's --sglang-server-concurrency default.
DEFAULT_SERVER_CONCURRENCY = 512
# Sequences sent to a server per sequence it runs. A group of n samples goes as one request and holds its n slots here
# until its last sample ends, while the server frees each sample's slot as soon as that sample ends: sending exactly
# the capacity would leave the batch short by the samples already finished in unfinished groups (about 28% with
# lengths uniform in [L/2, 3L/2] and n = 8: bench/rollout_client.py). SGLang queues the surplus and admits it at its
# next step, so a second capacity's worth keeps the batch full; it costs the server no KV cache until admitted.
OVERSUBSCRIPTION = 2


def server_capacity(info: dict | None) -> int | None:
    """``max_running_requests`` as a server's /server_info reports it, or None when it reports none.

    SGLang's /server_info merges the launch arguments (top level; None unless the flag was given) with the
    scheduler's state (``internal_states``, where the value the scheduler settled on appears); the latter wins."""
    if not isinstance(info, dict):
        return None
    states = info.get("internal_states")
    sources = [s for s in states if isinstance(s, dict)] if isinstance(states, list) else []
    for source in [*sources, info]:
        value = source.get("max_running_requests")
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def server_capacities(urls: list[str], infos: list[dict], override: int | None,
                      get: Callable[[str, str], Any]) -> tuple[list[int], list[str]]:
    """Each URL's capacity in sequences, and the URLs that are sglang-routers (they answer GET /workers with their
    workers, sglang-router >= 0.3; an SGLang server answers 404). A server's capacity is ``override``, else its
    /server_info's, else the default; a router's is the sum over its workers, each asked directly. ``get(url,
    path)`` returns the JSON answer, or None when there is none."""
    capacity = lambda info: override or server_capacity(info) or DEFAULT_SERVER_CONCURRENCY
    out, routers = [], []
    for url, info in zip(urls, infos):
        listed = get(url, "/workers")
        workers = listed.get("workers") if isinstance(listed, dict) else None
        if not isinstance(workers, list):
            out.append(capacity(info))
            continue
        routers.append(url)
        out.append(sum(capacity(get(str(w.get("url", "")).rstrip("/"), "/server_info")) for w in workers
                       if isinstance(w, dict)) or capacity(None))
    return out, routers


class Dispatcher:
    """Per-server outstanding sequences, capped at each server's capacity; lives on one asyncio loop (not
    thread-safe: call it from that loop only)."""

    def __init__(self, capacities: list[int]):
        if not capacities or any(c < 1 for c in capacities):
            raise ValueError(f"every server needs a capacity >= 1, got {capacities}")
        self.capacities = list(capacities)
        self.outstanding = [0] * len(capacities)
        self.alive = [True] * len(capacities)  # a dead server (health.py) takes nothing until it rejoins
        self.error: BaseException | None = None  # set by ``fail``: every acquire raises it
        self._waiting: deque[tuple[int, asyncio.Future, int | None]] = deque()

    @property
    def busy(self) -> bool:
        """Whether any request holds or waits for a slot."""
        return bool(self._waiting) or any(self.outstanding)

    def set_alive(self, server: int, alive: bool) -> None:
        self.alive[server] = alive
        self._grant()

    def fail(self, error: BaseException) -> None:
        """No server will take requests again: those waiting and those to come raise ``error``."""
        self.error = error
        while self._waiting:
            slot = self._waiting.popleft()[1]
            if not slot.done():
                slot.set_exception(error)

    def pick(self, n: int, avoid: int | None = None) -> int | None:
        """The server with the fewest outstanding sequences that has room for ``n`` more (lowest index on a tie), or
        None. A request larger than a whole server's capacity goes to an idle server rather than never. A retry
        ``avoid``s the server that just failed it, unless no other server is alive."""
        best = None
        if avoid is not None and not any(a for i, a in enumerate(self.alive) if i != avoid):
            avoid = None
        for i, (out, cap) in enumerate(zip(self.outstanding, self.capacities)):
            usable = self.alive[i] and i != avoid and (out + n <= cap or out == 0)
            if usable and (best is None or out < self.outstanding[best]):
                best = i
        return best

    async def acquire(self, n: int, avoid: int | None = None) -> int:
        """Wait for room for ``n`` sequences, in arrival order; returns the server, holding ``n`` of its slots."""
        if self.error is not None:
            raise self.error
        if not self._waiting:
            server = self.pick(n, avoid)
            if server is not None:
                self.outstanding[server] += n
                return server
        slot: asyncio.Future = asyncio.get_running_loop().create_future()
        self._waiting.append((n, slot, avoid))
        try:
            return await slot
        except asyncio.CancelledError:
            if slot.done() and not slot.cancelled():  # granted just as it was cancelled: give the slots back
                self.release(slot.result(), n)
            else:
                if (n, slot, avoid) in self._waiting:  # _grant may have dropped it already
                    self._waiting.remove((n, slot, avoid))
                self._grant()  # it may have blocked smaller requests behind it
            raise

    def release(self, server: int, n: int) -> None:
        self.outstanding[server] -= n
        self._grant()

    def _grant(self) -> None:
        while self._waiting:
            n, slot, avoid = self._waiting[0]
            if slot.done():  # cancelled while waiting: acquire removes it
                self._waiting.popleft()
                continue
            server = self.pick(n, avoid)
            if server is None:
                return
            self._waiting.popleft()
            self.outstanding[server] += n
            slot.set_result(server)
