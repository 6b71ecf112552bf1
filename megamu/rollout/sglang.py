"""SGLang rollout engine: server lifecycle and an HTTP client for ``/generate`` (see notes/sglang.md).

Only the standard library is used on the client side, so nothing of SGLang is imported by the trainer: servers are
separate processes (``python -m sglang.launch_server``), started here or given as URLs (servers or an sglang-router).
Requests run in a bounded thread pool; each is retried with exponential backoff on connection errors and 5xx
(on the next server, when there are several), never on a timeout (a retry would redo a long generation) or a 4xx.

Seeds: every sample is sent with its own ``sampling_seed``, but SGLang honours it only on servers launched with
``--enable-deterministic-inference`` (elsewhere it is ignored and sampling is random, so a resumed stage draws new
samples for its missing shards). ``SGLangEngine.deterministic`` says which; pass the flag in ``extra_server_args``.
"""

from __future__ import annotations

import ctypes
import http.client
import json
import os
import random
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
import weakref
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from megamu.rollout.types import GeneratedSample, GenerateRequest, SamplingParams, sample_seed


class SGLangError(RuntimeError):
    """A server that failed to start, or a request that failed after its retries; the message says which."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status  # the HTTP status of a refused request, if that is what failed


_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None
_PR_SET_PDEATHSIG = 1
_SIGTERM = int(signal.SIGTERM)


def _die_with_parent() -> None:
    """Popen preexec_fn: SIGTERM the server when the process that launched it dies, even by SIGKILL.

    Servers run in their own session (so they can be stopped as a group), which also means nothing else would stop
    them: a trainer killed by the OOM killer or a scheduler's SIGTERM would leave them holding the GPUs and the port.
    The ctypes handle is resolved before the fork, so the child only makes one libc call. Linux ties this to the
    launching *thread*: create the engine on a thread that lives as long as it (the main thread).
    """
    if _LIBC is not None:
        _LIBC.prctl(_PR_SET_PDEATHSIG, _SIGTERM)


# Servers are reached directly: an http_proxy set for pip on a cluster would otherwise carry even 127.0.0.1 requests.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def _port_in_use(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(1.0)
        return s.connect_ex(("127.0.0.1", port)) == 0


def _log_tail(path: Path, n: int = 40) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    return "\n".join(lines[-n:])


def _stop_processes(procs: list[subprocess.Popen], grace_s: float) -> None:
    """SIGTERM each server's process group (scheduler and detokenizer children included), then SIGKILL."""
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    end = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(max(0.0, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
        try:  # children may outlive the leader: kill the whole group by its id
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        p.wait()
    procs.clear()


def sampling_payload(sp: SamplingParams, seed: int | None = None) -> dict:
    """SGLang ``sampling_params`` of one sample. The seed is cut to 31 bits: some SGLang releases hold it in int32."""
    payload = {
        "temperature": sp.temperature,
        "top_p": sp.top_p,
        "top_k": sp.top_k if sp.top_k > 0 else -1,
        "max_new_tokens": sp.max_new_tokens,
        "stop_token_ids": list(sp.stop_token_ids),
        "skip_special_tokens": False,
        "no_stop_trim": True,  # keep the stop token: the policy must learn to emit it
    }
    if seed is not None:
        payload["sampling_seed"] = seed & 0x7FFFFFFF
    return payload


def parse_sample(result: dict, prompt_id: int, sample_index: int, stop_ids=()) -> GeneratedSample:
    """One SGLang result (``meta_info.output_token_logprobs`` = [[logprob, token_id, text], ...]) as a sample.

    Ids and log-probs both come from ``output_token_logprobs``, so there is exactly one log-prob per id whatever
    SGLang trims from ``output_ids``. SGLang checks the length limit before the stop tokens, so a reply whose last
    allowed token is a stop token comes back as "length"; it is complete, and LocalEngine calls it "stop": so do we.
    """
    meta = result.get("meta_info") or {}
    pairs = meta.get("output_token_logprobs")
    if pairs is None:
        raise SGLangError(f"response for prompt {prompt_id} has no meta_info.output_token_logprobs "
                          "(was return_logprob dropped by a proxy?)")
    reason = meta.get("finish_reason")
    kind = reason.get("type") if isinstance(reason, dict) else reason
    ids = [int(p[1]) for p in pairs]
    if kind == "length" and ids and ids[-1] in stop_ids:
        kind = "stop"
    return GeneratedSample(
        prompt_id=prompt_id,
        sample_index=sample_index,
        output_ids=ids,
        output_logprobs=[float(p[0]) for p in pairs],
        finish_reason=kind if kind in ("stop", "length") else "abort",
    )


class SGLangEngine:
    """Launch SGLang servers for ``hf_dir`` (or use ``urls``) and generate through their HTTP API."""

    name = "sglang"

    def __init__(
        self,
        hf_dir: str | None,
        *,
        urls: list[str] | None = None,
        num_servers: int = 1,
        tp_size: int = 1,
        api_key: str | None = None,
        port_base: int = 30000,
        startup_timeout_s: float = 600.0,
        max_concurrency: int = 256,
        request_timeout_s: float = 3600.0,
        max_retries: int = 5,
        backoff_s: float = 1.0,
        extra_server_args: list[str] = (),
        log_dir: str | None = None,
        shutdown_grace_s: float = 30.0,
    ):
        self.api_key = api_key if api_key is not None else os.environ.get("SGLANG_API_KEY")
        self.request_timeout_s = request_timeout_s
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self._procs: list[subprocess.Popen] = []
        self._finalizer = weakref.finalize(self, _stop_processes, self._procs, shutdown_grace_s)
        self._run_id = uuid.uuid4().hex[:8]
        self.deterministic: bool | None = None  # do all servers honour sampling_seed? None: could not tell
        if urls:
            self.urls = [u.rstrip("/") for u in urls]
            self._wait_healthy(startup_timeout_s, logs=[])
        else:
            if hf_dir is None:
                raise ValueError("SGLangEngine needs hf_dir (to launch servers) or urls (--sglang-url)")
            self.api_key = self.api_key or secrets.token_hex(16)
            self.urls, logs = self._launch(str(hf_dir), num_servers, tp_size, port_base, list(extra_server_args),
                                           Path(log_dir) if log_dir else Path(hf_dir).parent / "sglang_logs")
            self._wait_healthy(startup_timeout_s, logs, model_path=str(hf_dir))
        if self.deterministic is False:
            print("[sglang] servers run without --enable-deterministic-inference: sampling_seed is ignored, so "
                  "rollouts are not reproducible (a resumed stage draws new samples for its missing shards)")
        self._pool = ThreadPoolExecutor(max_workers=max_concurrency, thread_name_prefix="sglang-http")

    # ---- server lifecycle -------------------------------------------------------------------------------------
    def _launch(self, hf_dir: str, num_servers: int, tp_size: int, port_base: int, extra: list[str], log_dir: Path):
        log_dir.mkdir(parents=True, exist_ok=True)
        urls, logs = [], []
        for i in range(num_servers):
            port = port_base + i
            if _port_in_use(port):  # a leftover server there would answer /health in place of ours
                self.shutdown()
                raise SGLangError(f"port {port} (SGLang server {i}) is already in use, maybe by a server left over "
                                  "from an earlier run; stop it or choose another port_base")
            cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", hf_dir, "--host", "127.0.0.1",
                   "--port", str(port), "--tp-size", str(tp_size), "--base-gpu-id", str(i * tp_size),
                   "--api-key", self.api_key, *extra]
            log = log_dir / f"server_{i}.log"
            with open(log, "w") as f:
                # Own session: the whole server (scheduler, detokenizer children) is one process group to stop.
                self._procs.append(subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True,
                                                    preexec_fn=_die_with_parent))
            urls.append(f"http://127.0.0.1:{port}")
            logs.append(log)
        return urls, logs

    def _wait_healthy(self, timeout_s: float, logs: list[Path], model_path: str | None = None) -> None:
        deadline = time.monotonic() + timeout_s
        honours_seeds = []
        for i, url in enumerate(self.urls):
            log = logs[i] if i < len(logs) else None
            while True:
                proc = self._procs[i] if i < len(self._procs) else None
                if proc is not None and proc.poll() is not None:
                    self.shutdown()
                    raise SGLangError(f"SGLang server {url} exited with code {proc.returncode} during startup; "
                                      f"log {log}:\n{_log_tail(log)}")
                try:
                    self._call(url, "/health", None, timeout=5.0)
                    break
                except (OSError, http.client.HTTPException, SGLangError):
                    pass
                if time.monotonic() > deadline:
                    tail = f"log {log}:\n{_log_tail(log)}" if log else "(not started by us: no log)"
                    self.shutdown()
                    raise SGLangError(f"SGLang server {url} not healthy after {timeout_s:.0f}s; {tail}")
                time.sleep(1.0)
            try:
                honours_seeds.append(self._check_server(url, model_path))
            except SGLangError:
                self.shutdown()
                raise
        self.deterministic = None if None in honours_seeds else all(honours_seeds)

    def _check_server(self, url: str, model_path: str | None) -> bool | None:
        """/health needs no API key in SGLang, so ask /server_info: is the key accepted, and is it our model?

        Returns whether the server honours sampling_seed (None: it did not say)."""
        try:
            info = self._call(url, "/server_info", None, timeout=60.0)
        except SGLangError as e:
            if e.status in (401, 403):
                raise SGLangError(f"SGLang server {url} rejected the API key (HTTP {e.status}); pass the server's key "
                                  "as api_key or SGLANG_API_KEY") from e
            info = None  # e.g. a router without /server_info: nothing more to check
        except (OSError, http.client.HTTPException):
            info = None
        if not isinstance(info, dict):
            return None
        served = info.get("model_path")
        if model_path is not None and served and os.path.realpath(served) != os.path.realpath(model_path):
            raise SGLangError(f"SGLang server {url} serves {served}, not {model_path}: another server holds the port")
        return bool(info.get("enable_deterministic_inference", False))

    def shutdown(self) -> None:
        if getattr(self, "_pool", None) is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
        self._finalizer()

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    # ---- HTTP ---------------------------------------------------------------------------------------------------
    def _call(self, url: str, path: str, body: dict | None, timeout: float):
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(url + path, data=data, headers=headers, method="GET" if body is None else "POST")
        try:
            with _OPENER.open(req, timeout=timeout) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as e:
            detail = e.read()[:500].decode(errors="replace")
            if e.code >= 500:
                raise ConnectionError(f"{url}{path}: HTTP {e.code}: {detail}") from e
            raise SGLangError(f"{url}{path}: HTTP {e.code}: {detail}", status=e.code) from e
        return json.loads(raw) if raw.strip() else None

    def _post_with_retries(self, urls: list[str], path: str, body: dict, what: str):
        """POST with retries; attempt k goes to urls[k % len(urls)], so a dead server's work moves on.

        A retry gets fresh request ids: SGLang answers 400 "Duplicate request ID" while the failed attempt is still
        known to the server (a dropped connection is only noticed after a while)."""
        delay = self.backoff_s
        for attempt in range(self.max_retries + 1):
            url = urls[attempt % len(urls)]
            sent = body
            if attempt and "rid" in body:
                rid = body["rid"]
                rid = [f"{r}-r{attempt}" for r in rid] if isinstance(rid, list) else f"{rid}-r{attempt}"
                sent = dict(body, rid=rid)
            try:
                return self._call(url, path, sent, timeout=self.request_timeout_s)
            except TimeoutError as e:
                raise SGLangError(f"{what}: no answer from {url} within {self.request_timeout_s}s") from e
            except urllib.error.URLError as e:
                if isinstance(e.reason, TimeoutError):
                    raise SGLangError(f"{what}: no answer from {url} within {self.request_timeout_s}s") from e
                error = e
            except (ConnectionError, http.client.HTTPException, OSError) as e:
                error = e
            if attempt == self.max_retries:
                raise SGLangError(f"{what}: failed after {self.max_retries + 1} attempts: {error}") from error
            time.sleep(delay)
            delay *= 2
        raise AssertionError("unreachable")

    def _generate_one(self, index: int, req: GenerateRequest) -> list[GeneratedSample]:
        sp = req.sampling
        what = f"/generate for prompt {req.prompt_id}"
        rid = f"megamu-{self._run_id}-{req.prompt_id}-{uuid.uuid4().hex[:6]}"
        # The group goes as a batch with one sampling_seed per sample, never as n copies of one request: those would
        # share one seed, and a server that honours seeds would return n identical samples (no group variance).
        seed = sp.seed if sp.seed is not None else random.getrandbits(63)
        body = {"input_ids": [req.prompt_ids] * sp.n, "rid": [f"{rid}-{j}" for j in range(sp.n)],
                "sampling_params": [sampling_payload(sp, sample_seed(seed, req.prompt_id, j)) for j in range(sp.n)],
                "return_logprob": True, "logprob_start_len": -1, "stream": False}
        urls = self.urls[index % len(self.urls) :] + self.urls[: index % len(self.urls)]
        out = self._post_with_retries(urls, "/generate", body, what) if sp.n > 0 else []
        results = out if isinstance(out, list) else [out]
        if len(results) != sp.n:
            raise SGLangError(f"{what}: expected {sp.n} samples, got {len(results)}")
        return [parse_sample(r, req.prompt_id, j, sp.stop_token_ids) for j, r in enumerate(results)]

    def generate(self, requests: list[GenerateRequest]) -> list[GeneratedSample]:
        futures = [self._pool.submit(self._generate_one, i, r) for i, r in enumerate(requests)]
        try:
            return [s for f in futures for s in f.result()]
        except BaseException:
            for f in futures:
                f.cancel()
            raise

    def update_weights(self, hf_dir: str | None = None, state_dict: dict | None = None) -> None:
        """Reload every server from an HF folder (``/update_weights_from_disk``)."""
        if state_dict is not None or hf_dir is None:
            raise NotImplementedError("SGLangEngine.update_weights takes an HF folder; in-memory weight pushes "
                                      "(/update_weights_from_distributed) are not wired yet")
        for url in self.urls:
            out = self._post_with_retries([url], "/update_weights_from_disk",
                                          {"model_path": str(hf_dir), "flush_cache": True}, f"weight update of {url}")
            if isinstance(out, dict) and out.get("success") is False:
                raise SGLangError(f"{url}/update_weights_from_disk({hf_dir}) failed: {out.get('message')}")
