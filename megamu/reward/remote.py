"""Client of a remote sandbox service (``--code-sandbox-url``): the code reward's executions run there instead.

Protocol (one execution per request), ``POST <url>`` with a JSON body::

    {"source": "<python program>", "stdin": "<text>" | null, "timeout_s": 10.0, "memory_mb": 1024,
     "output_bytes": 1048576}

answered by ``200`` with ``{"returncode": int | null, "stdout": str, "stderr": str, "timed_out": bool}``
(``returncode`` null when the program was killed at ``timeout_s``). The service runs ``source`` as ``__main__`` with
``stdin`` on standard input (closed when null), in whatever isolation it provides. Connection errors, timeouts and 5xx
answers are retried; a 4xx answer or a malformed body is an error at once.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from urllib.parse import urlparse

from megamu.reward.sandbox import DEFAULT_LIMITS, RunResult, SandboxLimits

RETRIES = 3
BACKOFF_S = 0.5  # doubled after each failed attempt
HTTP_SLACK_S = 30.0  # the request may take this much longer than the program's own limit (queueing at the service)


def _opener(url: str) -> urllib.request.OpenerDirector:
    host = urlparse(url).hostname or ""
    if host in ("127.0.0.1", "localhost", "::1"):  # a local service must not go through an HTTP proxy
        return urllib.request.build_opener(urllib.request.ProxyHandler({}))
    return urllib.request.build_opener()


def remote_run(url: str, source: str, *, stdin: str | None = None, limits: SandboxLimits = DEFAULT_LIMITS,
               retries: int = RETRIES) -> RunResult:
    """Run ``source`` on the sandbox service at ``url``; raises RuntimeError once ``retries`` attempts failed."""
    body = json.dumps({"source": source, "stdin": stdin, "timeout_s": limits.wall_s,
                       "memory_mb": limits.memory_bytes >> 20, "output_bytes": limits.output_bytes}).encode()
    opener, last = _opener(url), None
    for attempt in range(retries):
        if attempt:
            time.sleep(BACKOFF_S * 2 ** (attempt - 1))
        request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"}, method="POST")
        try:
            with opener.open(request, timeout=limits.wall_s + HTTP_SLACK_S) as response:
                reply = json.loads(response.read())
        except urllib.error.HTTPError as e:
            if e.code < 500:
                raise RuntimeError(f"sandbox service {url} rejected the request: HTTP {e.code} {e.reason}") from e
            last = e
            continue
        except (urllib.error.URLError, TimeoutError, ConnectionError, json.JSONDecodeError) as e:
            last = e
            continue
        try:
            return RunResult(returncode=reply["returncode"], stdout=str(reply["stdout"])[: limits.output_bytes],
                             stderr=str(reply["stderr"])[: limits.output_bytes], timed_out=bool(reply["timed_out"]),
                             pgid=0)
        except (KeyError, TypeError) as e:
            raise RuntimeError(f"sandbox service {url}: malformed reply {str(reply)[:200]!r}") from e
    raise RuntimeError(f"sandbox service {url}: no answer after {retries} attempts ({last})")
