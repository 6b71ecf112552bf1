"""SGLang rollout engine: an HTTP client for ``/generate`` and the weight-sync endpoints.

Nothing of SGLang is imported by the trainer: servers are separate processes (launch.py), started here or given as
URLs (servers or an sglang-router). /generate requests go through transport.py (asyncio + aiohttp), and each server is
kept full: it is sent twice its capacity in running sequences (``max_running_requests`` from its /server_info, or
``server_concurrency``), the next request going to the server with the fewest outstanding (dispatch.py); a router
gets the sum of its workers' capacities and places them itself. The few control calls (health, info, weight syncs)
use urllib in a small pool.
Every request is retried with exponential backoff on connection errors and 5xx, never on a timeout (a retry would
redo a long generation) or a 4xx. /generate requests are watched by health.py: a dead or hung server's requests go
to the live servers, and servers megamu launched are restarted.
Prompts are checked before anything is sent: an empty prompt or an out-of-vocabulary id kills a real server.

Seeds: every sample is sent with its own ``sampling_seed``, but SGLang honours it only on servers launched with
``--enable-deterministic-inference`` (slower batch-invariant kernels), which ``SGLangConfig.deterministic`` adds to
launched servers and requires of given ones. Without it sampling is random, so a resumed stage draws new samples for
its missing shards. ``SGLangEngine.deterministic`` says which.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import random
import secrets
import uuid
import weakref
from concurrent.futures import Future
from dataclasses import replace
from pathlib import Path

from megamu.engines.sglang.dispatch import OVERSUBSCRIPTION, Dispatcher, server_capacities
from megamu.engines.sglang.health import ServerState, Supervisor, wait_for_servers
from megamu.engines.sglang.launch import (
    PortInUse,
    SGLangConfig,
    startup_timeout,
    stop_processes,
)
from megamu.engines.sglang.pool import ServerPool
from megamu.engines.sglang.schema import SGLangError, parse_sample, sampling_payload
from megamu.engines.sglang.server_weights import ServerWeights
from megamu.engines.sglang.transport import AsyncTransport
from megamu.engines.types import GeneratedSample, GenerateRequest, check_prompts, describe_request, sample_seed


def _served_vocab_size(model_path: str | None) -> int | None:
    """vocab_size of the served model's config.json, when that folder is readable from here."""
    try:
        config = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, TypeError, ValueError):
        return None
    vocab = config.get("vocab_size", (config.get("text_config") or {}).get("vocab_size"))
    return int(vocab) if vocab else None


class SGLangEngine:
    """Launch SGLang servers for ``hf_dir`` (or use ``config.urls``) and generate through their HTTP API.

    ``SGLangEngine(hf_dir, config)``, or keyword overrides of SGLangConfig's fields (``urls=[...]`` etc.)."""

    name = "sglang"

    def __init__(self, hf_dir: str | None, config: SGLangConfig | None = None, **overrides):
        cfg = self.config = replace(config or SGLangConfig(), **overrides).placed()  # a run's is placed already
        self.pool = ServerPool(cfg, cfg.api_key if cfg.api_key is not None else os.environ.get("SGLANG_API_KEY"))
        self._finalizer = weakref.finalize(self, stop_processes, self.pool.procs, cfg.shutdown_grace_s)
        self._transport = None
        # what the servers serve, what every sync is checked against, what a restarted server gets back
        self.weights = ServerWeights(self.pool, cfg, self.teacher_forced_logprobs)
        self.deterministic: bool | None = None  # do all servers honour sampling_seed? None: could not tell
        self.launched = not cfg.urls
        self.keeps = False  # watches and restarts its servers for a dispatcher on another rank (keep_alive)
        self.hf_dir, logs = hf_dir, []
        if cfg.urls:
            self.pool.urls = [u.rstrip("/") for u in cfg.urls]
        else:
            if hf_dir is None:
                raise ValueError("SGLangEngine needs hf_dir (to launch servers) or urls (--sglang-url)")
            self.pool.api_key = self.pool.api_key or secrets.token_hex(16)
            log_dir = Path(cfg.log_dir) if cfg.log_dir else Path(hf_dir).parent / "sglang_logs"
            try:
                logs = self.pool.launch(str(hf_dir), log_dir)
            except (PortInUse, OSError) as e:
                self.shutdown()
                raise SGLangError(str(e)) from e
        self._wait_healthy(logs, model_path=None if cfg.urls else str(hf_dir))
        # where weight syncs, memory calls and probes go: the servers themselves, also behind a router (nodes.py)
        self.pool.control_urls = list(self.urls)
        if cfg.deterministic and self.deterministic is not True:
            self.shutdown()
            raise SGLangError("deterministic rollouts were asked for, but the servers at "
                              f"{', '.join(self.urls)} do not report --enable-deterministic-inference")
        if self.deterministic is False:
            print("[sglang] deterministic inference is off (the default; --rollout-deterministic turns it on, at a "
                  "cost in speed): sampling_seed is ignored, so a resumed stage draws new samples for its missing "
                  "shards")
        self.pool.open_control()
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        self._transport = AsyncTransport(headers)
        servers = [ServerState(u, i, self.pool.procs[i] if self.launched else None, logs[i] if logs else None)
                   for i, u in enumerate(self.urls)]
        self._health = Supervisor(self.pool, self.weights.sync, self.weights, servers,
                                  Dispatcher([OVERSUBSCRIPTION * c for c in self.capacities]), self._transport)
        print(f"[sglang] sequences in flight per {'router' if self.routers else 'server'}: "
              + ", ".join(f"{u} {c}" for u, c in zip(self.urls, self.capacities)))

    # ---- server lifecycle -------------------------------------------------------------------------------------
    def _wait_healthy(self, logs: list[Path], model_path: str | None) -> None:
        timeout = self.config.url_timeout_s if self.config.urls else startup_timeout(self.config, self.hf_dir)
        try:
            ready = wait_for_servers(lambda u, p, b, t: self.pool.call(u, p, b, timeout=t), self.urls, self.pool.procs,
                                     logs, timeout, given=bool(self.config.urls))
            self.pool.urls = [self.urls[i] for i in ready]  # given servers that never answered are left out, named
            infos = [self.check_server(url, model_path) for url in self.urls]
        except SGLangError:
            self.shutdown()
            raise
        self.read_limits(infos, model_path)
        self.capacities, self.routers = server_capacities(self.urls, infos, self.config.server_concurrency,
                                                          self.pool.get_or_none)

    def check_server(self, url: str, model_path: str | None) -> dict:
        """/health needs no API key in SGLang, so ask /server_info: is the key accepted, and is it our model?"""
        try:
            info = self.pool.call(url, "/server_info", None, timeout=60.0)
        except SGLangError as e:
            if e.status in (401, 403):
                raise SGLangError(f"SGLang server {url} rejected the API key (HTTP {e.status}); pass the server's key "
                                  "as api_key or SGLANG_API_KEY") from e
            info = None  # e.g. a router without /server_info: nothing more to check
        except (OSError, http.client.HTTPException):
            info = None
        if not isinstance(info, dict):
            return {}
        served = info.get("model_path")
        if model_path is not None and served and os.path.realpath(served) != os.path.realpath(model_path):
            raise SGLangError(f"SGLang server {url} serves {served}, not {model_path}: another server holds the port")
        try:  # after a weight update /model_info has the current model and weight version; /server_info does not
            info["model_info"] = self.pool.call(url, "/model_info", None, timeout=60.0) or {}
        except (SGLangError, OSError, http.client.HTTPException):
            info["model_info"] = {}
        return info

    def read_limits(self, infos: list[dict], model_path: str | None) -> None:
        """What prompts, syncs and samples are checked against: vocabulary, input limit, dtype, layout, version."""
        honours = [i.get("enable_deterministic_inference") if i else None for i in infos]
        self.deterministic = None if None in honours or not honours else all(bool(h) for h in honours)
        limits = [int(i["max_req_input_len"]) for i in infos if i.get("max_req_input_len")]
        self.max_input_len = min(limits) if limits else None  # SGLang refuses prompts of this length or more
        first = infos[0] if infos else {}
        served = (first.get("model_info") or {}).get("model_path") or first.get("model_path") or model_path
        self.vocab_size = self.config.vocab_size or _served_vocab_size(served)
        self.weights.read(infos, served, self.launched)  # also what a restarted server will load

    def refresh_capacities(self) -> None:
        """Ask the servers (a router: its workers) their capacities again."""
        self.capacities, self.routers = server_capacities(self.urls, [{}] * len(self.urls),
                                                          self.config.server_concurrency, self.pool.get_or_none)
        self._health.dispatcher.capacities = [OVERSUBSCRIPTION * c for c in self.capacities]

    def shutdown(self) -> None:
        self.pool.leave_routers()  # before the servers stop: no request goes there
        if getattr(self, "_health", None) is not None:
            self._health.close()
            self._health = None
        self.weights.close()
        if self._transport is not None:
            self._transport.close()
            self._transport = None
        self.pool.close()
        self._finalizer()

    @property
    def pids(self) -> list[int]:
        return self.pool.pids

    # the pool's, read here: what requests, weight syncs and memory calls go to (set on the pool: nodes.py points
    # control_urls past a router)
    urls = property(lambda self: self.pool.urls)
    control_urls = property(lambda self: self.pool.control_urls)
    api_key = property(lambda self: self.pool.api_key)

    # ---- generation -----------------------------------------------------------------------------------------------
    def check_requests(self, requests: list[GenerateRequest]) -> None:
        """Raise PromptError naming every prompt the servers would refuse or die on; sends nothing."""
        check_prompts(requests, self.vocab_size, self.max_input_len)

    async def _generate_one(self, req: GenerateRequest) -> list[GeneratedSample]:
        sp = req.sampling
        what = f"/generate for {describe_request(req)}"
        rid = f"megamu-{self.pool.run_id}-{req.prompt_id}-{uuid.uuid4().hex[:6]}"
        # The group goes as a batch with one sampling_seed per sample, never as n copies of one request: those would
        # share one seed, and a server that honours seeds would return n identical samples (no group variance).
        seed = sp.seed if sp.seed is not None else random.getrandbits(63)
        params = [sampling_payload(sp, sample_seed(seed, req.prompt_id, j)) for j in range(sp.n)]
        body = {"input_ids": [req.prompt_ids] * sp.n, "rid": [f"{rid}-{j}" for j in range(sp.n)],
                "sampling_params": params, "return_logprob": True, "logprob_start_len": -1, "stream": False}
        out = []
        if sp.n > 0 and self.routers:  # sglang-router takes one sample per request (a rid string, one map of
            # sampling params; a batch is refused with 422): each goes on its own, placed by the router
            out = await asyncio.gather(*(self._health.request(
                "/generate", {**body, "input_ids": req.prompt_ids, "rid": f"{rid}-{j}", "sampling_params": p}, 1, what)
                for j, p in enumerate(params)))
        elif sp.n > 0:  # to the least busy live server with room; a dead server's requests move on (health.py)
            out = await self._health.request("/generate", body, sp.n, what)
        results = out if isinstance(out, list) else [out]
        if len(results) != sp.n:
            raise SGLangError(f"{what}: expected {sp.n} samples, got {len(results)}")
        samples = [parse_sample(r, req.prompt_id, j, sp.stop_token_ids) for j, r in enumerate(results)]
        self.weights.check_samples(samples, what)
        return samples

    def keep_alive(self) -> None:
        """Probe and restart these servers all the time, not only while this engine sends requests: a node's servers
        that another rank dispatches to (nodes.py). Off between a colocated stage's rollouts (``watching``): a server
        busy loading a push may miss its probes, and must not be killed for it."""
        self._health.keeper = self.keeps = True

    def watching(self, on: bool) -> None:
        """Turn the probes of a node's own servers on for a rollout and off after it (only if it keeps them alive)."""
        if self.keeps:
            self._health.keeper = on

    def pause_probes(self) -> None:
        """Stop this engine's health probes and wait out those in flight, before the servers release their memory."""
        if self._health is not None:
            self._health.pause_probes(self.config.probe_timeout_s + 5.0)

    def resume_probes(self) -> None:
        if self._health is not None:
            self._health.resume_probes()

    def begin_stage(self) -> None:
        """A rollout phase starts: restart budgets and per-server counts start from zero."""
        self._health.begin_stage()

    def server_stats(self) -> list[dict]:
        """Per server, since ``begin_stage``: requests and samples answered, samples/s, restarts."""
        return self._health.stats()

    @property
    def health_events(self) -> list[dict]:
        """Deaths and restarts of servers, with their wall-clock times and causes."""
        return self._health.events

    @property
    def max_in_flight(self) -> int:
        """Requests the rollout phase keeps submitted: as many as the sequences the servers are sent, so at least
        that many requests of any n. Those the servers are not sent yet wait in the dispatcher, and start the moment
        a slot frees, while the phase scores and writes a shard."""
        return OVERSUBSCRIPTION * sum(self.capacities)

    def submit(self, index: int, request: GenerateRequest) -> Future:
        """Start one request (its n samples) in the background; the future holds its samples, in order. ``index``
        labels it only: the dispatcher picks the server."""
        return self._transport.submit(self._generate_one(request))

    def generate(self, requests: list[GenerateRequest]) -> list[GeneratedSample]:
        self.check_requests(requests)
        futures = [self.submit(i, r) for i, r in enumerate(requests)]
        try:
            return [s for f in futures for s in f.result()]
        except BaseException:
            for f in futures:
                f.cancel()
            raise

    def teacher_forced_logprobs(self, token_ids: list[int], url: str | None = None) -> list[float]:
        """log p(token_ids[i] | token_ids[:i]) for i >= 1 at temperature 1, from one server (no token generated)."""
        body = {"input_ids": list(token_ids), "return_logprob": True, "logprob_start_len": 0,
                "sampling_params": {"max_new_tokens": 0, "temperature": 1.0}, "stream": False}
        out = self.pool.post_with_retries([url or self.urls[0]], "/generate", body, "teacher-forced log-prob probe")
        pairs = (out.get("meta_info") or {}).get("input_token_logprobs") or []
        return [float(p[0]) for p in pairs[1:]]

    # ---- weight sync (ServerWeights' business; these are the Engine protocol's names for it) -----------------------
    # the weights' state, read here (tests and the log name them on the engine)
    sync = property(lambda self: self.weights.sync)
    layout = property(lambda self: self.weights.layout)
    server_dtype = property(lambda self: self.weights.server_dtype)

    @property
    def weight_version(self) -> str | None:
        return self.weights.version

    @weight_version.setter
    def weight_version(self, version: str | None) -> None:  # tests: samples of another version are refused
        self.weights.version = version

    def update_weights(self, hf_dir: str | None = None, state_dict: dict | None = None, *, version=None,
                       probe=None):
        """Sync every server to new weights (an HF folder, or an HF-named state dict sent in memory); returns a
        SyncReport. Refused before anything is sent when the weights do not fit the running model; ``version`` (the
        policy version; default: one more than the last) is set on the servers and checked on every sample."""
        return self.weights.update(hf_dir, state_dict, version, probe)

    def check_pushable(self, state_dict: dict) -> None:
        """Refuse in-memory weights that do not fit the running model, before anyone sends them."""
        self.weights.check_pushable(state_dict)

    def pushed_by_ranks(self, state_dict: dict, version) -> None:
        """The trainer's ranks pushed ``state_dict`` to this node's servers themselves (rank_push.py): expect
        ``version`` on its samples, and keep the host copy a restarted server gets back."""
        self.weights.pushed_by_ranks(state_dict, version)

    def adopt_weights(self, version, probe=None):
        """Weights that each node pushed to its own servers: every server must report ``version`` (it is then
        checked on every sample) and match the probe; returns a SyncReport (no bytes: others sent them)."""
        return self.weights.confirm(version, probe)
