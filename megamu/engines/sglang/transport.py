"""The /generate data plane: one asyncio event loop in a background thread, an aiohttp session whose connector keeps
a pool of connections per server, and the dispatcher that fills each server to its capacity.

Why asyncio: bench/rollout_client.py measured the thread-per-request urllib client against this one on simulated
SGLang servers (its docstring has the table). As verl's and slime's rollout clients do, thousands of requests are
held by coroutines on one thread, with kept-alive connections, instead of one OS thread and one new TCP connection
per request.

Error classes are those of the urllib path in client.py, so the retry policy there applies unchanged: HTTP 5xx and
connection failures are ``ConnectionError`` (retried), other HTTP errors ``HTTPRefused`` (never retried), and a
request that outlives its timeout ``TimeoutError`` (never retried).
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Awaitable
from concurrent.futures import Future


def attempt_body(body: dict, attempt: int) -> dict:
    """The body of retry ``attempt`` (both paths): fresh request ids, since SGLang answers 400 "Duplicate request
    ID" while a failed attempt is still known to the server."""
    if not attempt or "rid" not in body:
        return body
    rid = body["rid"]
    return dict(body, rid=[f"{r}-r{attempt}" for r in rid] if isinstance(rid, list) else f"{rid}-r{attempt}")


class HTTPRefused(Exception):
    """A 4xx answer: the server refused this request and would refuse it again."""

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status


class Unreachable(ConnectionError):
    """Nothing listens at the server's address (connection refused or no route): it is gone, not busy."""


class AsyncTransport:
    """Runs coroutines on a private event loop; ``submit`` hands back a concurrent.futures.Future."""

    def __init__(self, headers: dict[str, str], thread_name: str = "sglang-asyncio"):
        self.headers = dict(headers)
        self.loop = asyncio.new_event_loop()
        self._session = None
        self._thread = threading.Thread(target=self.loop.run_forever, name=thread_name, daemon=True)
        self._thread.start()

    def submit(self, coro: Awaitable) -> Future:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Awaitable):
        """Run ``coro`` on the loop and wait for its result (from any thread but the loop's)."""
        return self.submit(coro).result()

    async def _get_session(self):
        if self._session is None:
            import aiohttp

            # No connection limit here (the dispatcher bounds what is in flight); trust_env off: an http_proxy set
            # for pip on a cluster must not carry requests to our servers.
            connector = aiohttp.TCPConnector(limit=0, limit_per_host=0, keepalive_timeout=60)
            self._session = aiohttp.ClientSession(connector=connector, headers=self.headers, trust_env=False,
                                                  json_serialize=json.dumps)
        return self._session

    async def _request(self, method: str, url: str, path: str, timeout: float, **kw) -> tuple[int, bytes]:
        """(status, body) of one request; aiohttp's errors as this module's: TimeoutError, Unreachable (nothing
        listens there), ConnectionError (reset, dropped before the answer, malformed answer)."""
        import aiohttp

        session = await self._get_session()
        try:
            async with session.request(method, url + path, timeout=aiohttp.ClientTimeout(total=timeout), **kw) as resp:
                return resp.status, await resp.read()
        except TimeoutError as e:  # aiohttp's total timeout; TimeoutError itself on Python >= 3.11
            raise TimeoutError(f"{url}{path}: no answer within {timeout}s") from e
        except aiohttp.ClientConnectorError as e:  # refused: nothing listens there
            raise Unreachable(f"{url}{path}: {type(e).__name__}: {e}") from e
        except aiohttp.ClientError as e:
            raise ConnectionError(f"{url}{path}: {type(e).__name__}: {e}") from e

    async def post(self, url: str, path: str, body: dict, timeout: float):
        """POST ``body`` as JSON; the decoded JSON answer (None for an empty body). A 5xx is a ConnectionError (the
        server may answer a retry), a 4xx an HTTPRefused."""
        status, raw = await self._request("POST", url, path, timeout, data=json.dumps(body).encode(),
                                          headers={"Content-Type": "application/json"})
        if status >= 400:
            detail = raw[:500].decode(errors="replace")
            if status >= 500:
                raise ConnectionError(f"{url}{path}: HTTP {status}: {detail}")
            raise HTTPRefused(f"{url}{path}: HTTP {status}: {detail}", status)
        return json.loads(raw) if raw.strip() else None

    async def get(self, url: str, path: str, timeout: float) -> int:
        """GET ``path`` and return the HTTP status (health probes); errors as ``post``'s, any status is an answer."""
        return (await self._request("GET", url, path, timeout))[0]

    def close(self) -> None:
        if not self.loop.is_running():
            return

        async def _close():
            if self._session is not None:
                await self._session.close()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        try:
            asyncio.run_coroutine_threadsafe(_close(), self.loop).result(timeout=10)
        except Exception:  # noqa: BLE001 - closing must not fail; the loop is stopped below either way
            pass
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)
        if not self.loop.is_running():
            self.loop.close()
