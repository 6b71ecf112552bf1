"""The SGLang servers an engine talks to, and the control calls it makes to them (health, info, weight syncs, memory).

``ServerPool`` is what the engine's sibling modules share: the servers' URLs (those requests go to, and those weight
syncs, memory calls and probes go to: the same, except behind a router), the API key, the processes of servers megamu
launched with the folder and log folder they were launched from (a restart launches one again the same way), and the
control calls over urllib in a small thread pool. /generate requests do not go through here: they
take the asyncio transport (transport.py), watched by health.py.
Every call is retried with exponential backoff on connection errors and 5xx, never on a 4xx (the server refused it,
and would again). Control calls to every server (``post_all``) wait at most ``control_timeout_s`` per attempt (a
disk reload: the model's load time, launch.load_seconds), all attempts bounded by ``max_retries``; slime retries its
control posts on any error (slime/utils/http_utils.py:165-190, 60 tries 1 s apart). After a timeout only a call that
can run twice is sent again (``/update_weights_from_disk``: the same folder and version loaded again). The memory
calls and weight-update sessions are not: the first may still be running, and SGLang applies them twice badly (a
second resume of a tag raises KeyError in its scheduler, ``offload_tags.remove``, scheduler_components/
weight_updater.py:390; torch_memory_saver refuses to pause an allocation twice, "Cannot pause allocation that is not
active"), while a second request would only queue behind a hung first one. /generate and the in-memory broadcasts
are not sent again after a timeout either: a retry would redo a long generation, and a bucket's broadcast happened
once, with the first request; a push that fails is sent again whole (push_recovery.py).
"""

from __future__ import annotations

import http.client
import json
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from megamu.engines.sglang.launch import SGLangConfig, launch_server, launch_servers
from megamu.engines.sglang.schema import SGLangError
from megamu.engines.sglang.transport import attempt_body

# Control calls that may be sent again after a timeout: the server ends in the same state however often it runs them.
REPEATABLE = frozenset({"/update_weights_from_disk"})
# Servers are reached directly: an http_proxy set for pip on a cluster would otherwise carry even 127.0.0.1 requests.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class ServerPool:
    """Servers' URLs, key and processes, and the calls to them."""

    def __init__(self, config: SGLangConfig, api_key: str | None):
        self.config, self.api_key = config, api_key
        self.urls: list[str] = []  # where requests go (servers, or a router)
        self.control_urls: list[str] = []  # where weight syncs, memory calls and probes go: the servers themselves
        self.procs: list = []  # processes of the servers megamu launched (index i serves urls[i])
        self.hf_dir: str | None = None  # what the launched servers load, and a restarted one again (``relaunch``)
        self.log_dir: Path | None = None
        self.run_id = uuid.uuid4().hex[:8]  # in request ids and weight-group names: this engine's, not another's
        self.router_workers: list[tuple[str, str]] = []  # (router, worker id) pairs this engine added (nodes.py)
        self.executor: ThreadPoolExecutor | None = None  # control calls to every server at once (``post_all``)

    def launch(self, hf_dir: str, log_dir: Path) -> list[Path]:
        """Start the config's servers on this node for ``hf_dir``, logging under ``log_dir``; their log files. Each
        process is in ``procs`` as soon as it starts, so a failed launch still stops those started."""
        self.hf_dir, self.log_dir = hf_dir, log_dir
        self.urls, logs = launch_servers(self.config, hf_dir, self.api_key, self.procs, log_dir)
        return logs

    def relaunch(self, index: int, restart: int) -> tuple[subprocess.Popen, Path]:
        """Start launched server ``index`` again as ``launch`` did (its place on the node and in ``procs`` are the
        same: launch numbers them alike), once its old process is stopped; its process and the restart's own log."""
        proc, log = launch_server(self.config, self.hf_dir, self.api_key, index, self.log_dir, restart=restart)
        self.procs[index] = proc  # stopped with the others at shutdown
        return proc, log

    def open_control(self) -> None:
        self.executor = ThreadPoolExecutor(max_workers=max(4, len(self.urls)), thread_name_prefix="sglang-control")

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def call(self, url: str, path: str, body: dict | None, timeout: float, method: str | None = None):
        """One request, no retry; 5xx raise ConnectionError (retried by ``post_with_retries``), 4xx SGLangError."""
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(url + path, data=data, headers=headers,
                                     method=method or ("GET" if body is None else "POST"))
        try:
            with _OPENER.open(req, timeout=timeout) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as e:
            detail = e.read()[:500].decode(errors="replace")
            if e.code >= 500:
                raise ConnectionError(f"{url}{path}: HTTP {e.code}: {detail}") from e
            raise SGLangError(f"{url}{path}: HTTP {e.code}: {detail}", status=e.code) from e
        if not raw.strip():
            return None
        try:
            return json.loads(raw)
        except ValueError:  # a plain-text answer (sglang-router's /health: "OK")
            return raw.decode(errors="replace")

    def get_or_none(self, url: str, path: str):
        try:
            return self.call(url, path, None, timeout=30.0)
        except (SGLangError, OSError, http.client.HTTPException, ValueError):
            return None

    def post_with_retries(self, urls: list[str], path: str, body: dict, what: str, timeout: float | None = None,
                          retry_timeouts: bool = False):
        """POST with retries; attempt k goes to urls[k % len(urls)], so a dead server's work moves on.

        A 4xx is never retried: the server refused this request, and would refuse it again. A timeout is retried
        only for ``retry_timeouts`` (control calls that can be sent again: ``post_all``).
        A retry gets fresh request ids: SGLang answers 400 "Duplicate request ID" while the failed attempt is still
        known to the server (a dropped connection is only noticed after a while)."""
        delay = self.config.backoff_s
        retries = self.config.max_retries
        timeout = self.config.request_timeout_s if timeout is None else timeout
        for attempt in range(retries + 1):
            url = urls[attempt % len(urls)]
            try:
                return self.call(url, path, attempt_body(body, attempt), timeout=timeout)
            except SGLangError as e:
                raise SGLangError(f"{what}: refused: {e}", status=e.status) from e
            except (TimeoutError, urllib.error.URLError) as e:
                timed_out = isinstance(e, TimeoutError) or isinstance(getattr(e, "reason", None), TimeoutError)
                if timed_out and not retry_timeouts:
                    raise SGLangError(f"{what}: no answer from {url} within {timeout}s") from e
                error = TimeoutError(f"no answer from {url} within {timeout}s") if timed_out else e
            except (ConnectionError, http.client.HTTPException, OSError) as e:
                error = e
            if attempt == retries:
                raise SGLangError(f"{what}: failed after {retries + 1} attempts: {error}") from error
            time.sleep(delay)
            delay *= 2
        raise AssertionError("unreachable")

    def post_all(self, path: str, body: dict, what: str, urls: list[str] | None = None,
                 timeout: float | None = None) -> list:
        """The same request to every server (or ``urls``) at once (weight syncs, memory); raises if any says it
        failed. A router's workers are reached directly: weight syncs are not routed. Each attempt waits at most
        ``timeout`` (default ``control_timeout_s``); one that times out is sent again, within ``max_retries``, when
        the call is REPEATABLE (see the module's docstring)."""
        urls = self.control_urls if urls is None else urls
        timeout = self.config.control_timeout_s if timeout is None else timeout
        futures = [self.executor.submit(self.post_with_retries, [u], path, body, f"{what} on {u}", timeout,
                                        path in REPEATABLE) for u in urls]
        outs = [f.result() for f in futures]
        for url, out in zip(urls, outs):
            if isinstance(out, dict) and out.get("success") is False:
                raise SGLangError(f"{what} on {url} failed: {out.get('message')}")
        return outs

    def begin_weight_update(self, urls: list[str] | None = None) -> bool:
        """Open an in-memory weight-update session; False where the server has no such session. SGLang 0.5.23 makes
        ``/update_weights_from_tensor`` and ``/update_weights_from_distributed`` sit between ``/begin_weight_update``
        and ``/end_weight_update`` (400 otherwise); 0.5.15.post1, the SGLang of slime's image that the Dockerfile
        pins, has neither route (its ``http_server.py``: 404) and takes the updates unbracketed."""
        try:
            self.post_all("/begin_weight_update", {}, "begin weight update", urls)
        except SGLangError as e:
            if e.status == 404:
                return False
            raise
        return True

    def end_weight_update(self, bracketed: bool, urls: list[str] | None = None) -> None:
        if bracketed:
            self.post_all("/end_weight_update", {}, "end weight update", urls)

    def leave_routers(self) -> None:
        """Remove the workers this engine added to routers, before the servers stop: no request goes there."""
        for router, worker in self.router_workers:
            try:
                self.call(router, f"/workers/{urllib.parse.quote(worker, safe='')}", None, timeout=30.0,
                          method="DELETE")
            except (SGLangError, OSError, http.client.HTTPException):
                pass  # the router drops a worker that stopped answering anyway
        self.router_workers = []

    def close(self) -> None:
        if self.executor is not None:
            self.executor.shutdown(wait=False, cancel_futures=True)
