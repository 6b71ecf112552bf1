"""SGLang rollout engine: server lifecycle and an HTTP client for ``/generate`` (see notes/sglang.md).

Only the standard library is used on the client side, so nothing of SGLang is imported by the trainer: servers are
separate processes (``python -m sglang.launch_server``), started here or given as URLs (servers or an sglang-router).
Requests run in a bounded thread pool; each is retried with exponential backoff on connection errors and 5xx
(on the next server, when there are several), never on a timeout (a retry would redo a long generation) or a 4xx.
"""

from __future__ import annotations

import http.client
import json
import os
import secrets
import signal
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
        payload["sampling_seed"] = seed
    return payload


def parse_sample(result: dict, prompt_id: int, sample_index: int) -> GeneratedSample:
    """One SGLang result (``meta_info.output_token_logprobs`` = [[logprob, token_id, text], ...]) as a sample."""
    meta = result.get("meta_info") or {}
    pairs = meta.get("output_token_logprobs")
    if pairs is None:
        raise SGLangError(f"response for prompt {prompt_id} has no meta_info.output_token_logprobs "
                          "(was return_logprob dropped by a proxy?)")
    reason = meta.get("finish_reason")
    kind = reason.get("type") if isinstance(reason, dict) else reason
    return GeneratedSample(
        prompt_id=prompt_id,
        sample_index=sample_index,
        output_ids=[int(p[1]) for p in pairs],
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
        if urls:
            self.urls = [u.rstrip("/") for u in urls]
            self._wait_healthy(startup_timeout_s, logs=[])
        else:
            if hf_dir is None:
                raise ValueError("SGLangEngine needs hf_dir (to launch servers) or urls (--sglang-url)")
            self.api_key = self.api_key or secrets.token_hex(16)
            self.urls, logs = self._launch(str(hf_dir), num_servers, tp_size, port_base, list(extra_server_args),
                                           Path(log_dir) if log_dir else Path(hf_dir).parent / "sglang_logs")
            self._wait_healthy(startup_timeout_s, logs)
        self._pool = ThreadPoolExecutor(max_workers=max_concurrency, thread_name_prefix="sglang-http")

    # ---- server lifecycle -------------------------------------------------------------------------------------
    def _launch(self, hf_dir: str, num_servers: int, tp_size: int, port_base: int, extra: list[str], log_dir: Path):
        log_dir.mkdir(parents=True, exist_ok=True)
        urls, logs = [], []
        for i in range(num_servers):
            port = port_base + i
            cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", hf_dir, "--host", "127.0.0.1",
                   "--port", str(port), "--tp-size", str(tp_size), "--base-gpu-id", str(i * tp_size),
                   "--api-key", self.api_key, *extra]
            log = log_dir / f"server_{i}.log"
            with open(log, "w") as f:
                # Own session: the whole server (scheduler, detokenizer children) is one process group to stop.
                self._procs.append(subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True))
            urls.append(f"http://127.0.0.1:{port}")
            logs.append(log)
        return urls, logs

    def _wait_healthy(self, timeout_s: float, logs: list[Path]) -> None:
        deadline = time.monotonic() + timeout_s
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
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as e:
            detail = e.read()[:500].decode(errors="replace")
            if e.code >= 500:
                raise ConnectionError(f"{url}{path}: HTTP {e.code}: {detail}") from e
            raise SGLangError(f"{url}{path}: HTTP {e.code}: {detail}") from e
        return json.loads(raw) if raw.strip() else None

    def _post_with_retries(self, urls: list[str], path: str, body: dict, what: str):
        """POST with retries; attempt k goes to urls[k % len(urls)], so a dead server's work moves on."""
        delay = self.backoff_s
        for attempt in range(self.max_retries + 1):
            url = urls[attempt % len(urls)]
            try:
                return self._call(url, path, body, timeout=self.request_timeout_s)
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
        if sp.seed is None or sp.n == 1:
            params = sampling_payload(sp, None if sp.seed is None else sample_seed(sp.seed, req.prompt_id, 0))
            body = {"input_ids": req.prompt_ids, "sampling_params": dict(params, n=sp.n), "rid": rid}
        else:
            # SGLang's n copies would share one sampling_seed: send the group as a batch, one seed per sample.
            body = {"input_ids": [req.prompt_ids] * sp.n, "rid": [f"{rid}-{j}" for j in range(sp.n)],
                    "sampling_params": [sampling_payload(sp, sample_seed(sp.seed, req.prompt_id, j))
                                        for j in range(sp.n)]}
        body.update(return_logprob=True, logprob_start_len=-1, stream=False)
        urls = self.urls[index % len(self.urls) :] + self.urls[: index % len(self.urls)]
        out = self._post_with_retries(urls, "/generate", body, what)
        results = out if isinstance(out, list) else [out]
        if len(results) != sp.n:
            raise SGLangError(f"{what}: expected {sp.n} samples, got {len(results)}")
        return [parse_sample(r, req.prompt_id, j) for j, r in enumerate(results)]

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
