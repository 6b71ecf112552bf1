"""Keeping every SGLang server at its capacity: the dispatcher's choices (hand-worked), capacities read from servers
and routers, and the limits a schema server observes under load."""

import asyncio

import pytest

from megamu.engines import make_engine
from megamu.engines.local import LocalEngine
from megamu.engines.sglang.client import SGLangError
from megamu.engines.sglang.dispatch import (
    DEFAULT_SERVER_CONCURRENCY,
    OVERSUBSCRIPTION,
    Dispatcher,
    server_capacity,
)
from megamu.engines.sglang.launch import DETERMINISTIC_FLAG, SGLangConfig, server_command
from megamu.engines.types import GenerateRequest, SamplingParams
from tests.engines.schema_server import SchemaServer


def test_least_outstanding_with_room_first_come_first_served():
    async def scenario():
        d = Dispatcher([4, 8])
        assert await d.acquire(3) == 0  # both idle: the lower index
        assert await d.acquire(3) == 1  # 3 outstanding on 0, 0 on 1
        assert await d.acquire(3) == 1  # 0 has no room for 3 more (3 + 3 > 4); 1 has 3 + 3 <= 8
        assert d.outstanding == [3, 6]
        first = asyncio.ensure_future(d.acquire(3))  # neither has room: waits
        second = asyncio.ensure_future(d.acquire(1))  # 0 has room for 1, but it came later: it waits behind first
        await asyncio.sleep(0)
        assert not first.done() and not second.done()
        d.release(1, 3)  # 1 now holds 3: first goes there (fewest outstanding with room), then second to 0
        await asyncio.sleep(0)
        assert (first.result(), second.result(), d.outstanding) == (1, 0, [4, 6])
        big = asyncio.ensure_future(d.acquire(9))  # larger than any server: waits for an idle one
        await asyncio.sleep(0)
        d.release(0, 4)
        await asyncio.sleep(0)
        assert big.result() == 0 and d.outstanding == [9, 6]
        waiting = asyncio.ensure_future(d.acquire(5))
        await asyncio.sleep(0)
        waiting.cancel()  # a cancelled waiter leaves the queue and takes nothing
        await asyncio.gather(waiting, return_exceptions=True)
        d.release(0, 9)
        d.release(1, 6)
        assert d.outstanding == [0, 0] and not d._waiting

    asyncio.run(scenario())
    with pytest.raises(ValueError):
        Dispatcher([4, 0])


def test_server_capacity_from_server_info():
    assert server_capacity({"max_running_requests": None, "internal_states": [{"max_running_requests": 2048}]}) == 2048
    assert server_capacity({"max_running_requests": 300}) == 300  # the launch flag, when the scheduler says nothing
    assert server_capacity({"max_running_requests": None}) is None
    assert server_capacity({"internal_states": [{"max_running_requests": True}]}) is None
    assert server_capacity(None) is None


def _engine(urls, **kw):
    return make_engine("sglang", None, urls=urls, **dict(dict(api_key="secret", backoff_s=0.01), **kw))


def _requests(count, n):
    sp = SamplingParams(temperature=1.0, max_new_tokens=4, n=n, seed=3)
    return [GenerateRequest(i, [5 + i % 7, 9, 14], sp) for i in range(count)]


def test_each_server_is_kept_at_its_reported_capacity(server, tiny_llama):
    other = SchemaServer(LocalEngine(tiny_llama))
    try:
        server.max_running_requests, other.max_running_requests = 3, 6
        for s in (server, other):
            s.delay_s = 0.3  # requests overlap long enough for the peak to be seen
        engine = _engine([server.url, other.url])
        assert engine.capacities == [3, 6] and engine.max_in_flight == 18 and engine.routers == []
        out = engine.generate(_requests(9, n=3))
        assert len(out) == 27
        # each is sent twice its capacity (OVERSUBSCRIPTION), never more, and both are filled at once: the first six
        # requests go to 0, 1, 0, 1, 1, 1 (fewest outstanding with room, the lower index on a tie)
        assert OVERSUBSCRIPTION == 2 and (server.peak_running, other.peak_running) == (6, 12)
        assert len(server.log) + len(other.log) == 9 and len(other.log) > len(server.log)
        engine.shutdown()
        forced = _engine([server.url, other.url], server_concurrency=12)  # the flag overrides what servers say
        assert forced.capacities == [12, 12]
        forced.shutdown()
        server.max_running_requests = other.max_running_requests = None
        unknown = _engine([server.url])
        assert unknown.capacities == [DEFAULT_SERVER_CONCURRENCY]
        unknown.shutdown()
    finally:
        other.close()


def test_a_router_gets_the_sum_of_its_workers(server, tiny_llama):
    workers = [SchemaServer(LocalEngine(tiny_llama)) for _ in range(2)]
    try:
        workers[0].max_running_requests, workers[1].max_running_requests = 256, 1024
        server.workers = [w.url for w in workers]  # `server` answers as the router in front of them
        engine = _engine([server.url])
        assert engine.routers == [server.url] and engine.capacities == [1280]
        assert len(engine.generate(_requests(2, n=2))) == 4 and len(server.log) == 4  # a sample per request
        engine.shutdown()
    finally:
        for w in workers:
            w.close()


def test_deterministic_inference_is_opt_in(server):
    assert DETERMINISTIC_FLAG not in server_command(SGLangConfig(), "/m", 30000, 0, "k")
    cmd = server_command(SGLangConfig(deterministic=True), "/m", 30000, 0, "k")
    assert cmd.count(DETERMINISTIC_FLAG) == 1
    both = SGLangConfig(deterministic=True, extra_server_args=[DETERMINISTIC_FLAG])
    assert server_command(both, "/m", 30000, 0, "k").count(DETERMINISTIC_FLAG) == 1
    server.deterministic = False
    with pytest.raises(SGLangError, match="deterministic rollouts were asked for"):
        _engine([server.url], deterministic=True)
    server.deterministic = True
    engine = _engine([server.url], deterministic=True)
    assert engine.deterministic is True
    engine.shutdown()
