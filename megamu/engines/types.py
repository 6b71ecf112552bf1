"""The engine protocol: what every rollout engine (in-process or SGLang) takes and returns."""

from __future__ import annotations

import hashlib
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Protocol

FINISH_REASONS = ("stop", "length", "abort")


@dataclass
class SamplingParams:
    """Sampling settings of one request. ``top_k`` 0 or -1 and ``top_p`` 1.0 mean off; temperature 0 means greedy.

    Behaviour log-probs are always of the temperature-scaled *full* distribution, log_softmax(logits / T), as SGLang
    returns them: top-k / top-p only restrict which tokens may be sampled.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 128
    n: int = 1
    stop_token_ids: list[int] = field(default_factory=list)
    seed: int | None = None


@dataclass
class GenerateRequest:
    prompt_id: int
    prompt_ids: list[int]
    sampling: SamplingParams
    source: str = ""  # where the prompt came from ("file: row N"), named in errors about it


@dataclass
class GeneratedSample:
    prompt_id: int
    sample_index: int
    output_ids: list[int]  # includes the stop/EOS token when finish_reason == "stop"
    output_logprobs: list[float]  # one per output id
    finish_reason: str  # "stop" | "length" | "abort"
    weight_version: str | None = None  # the weights that made it, as the engine reported them (None: not reported)


class PromptError(ValueError):
    """Requests an engine refuses before sending anything: the message names each bad prompt's id and source."""


def describe_request(req: GenerateRequest) -> str:
    return f"prompt {req.prompt_id}" + (f" ({req.source})" if req.source else "")


def check_prompts(requests: list[GenerateRequest], vocab_size: int | None, max_input_len: int | None) -> None:
    """Refuse empty prompts, ids outside [0, vocab_size) and prompts of ``max_input_len`` tokens or more (SGLang's
    ``max_req_input_len``: it refuses those), all at once.

    An empty prompt or an out-of-vocabulary id kills a real SGLang 0.5.23 server's scheduler (tried on its CPU
    build), so these must never be sent; checking the whole list first names every bad row before any work is done."""
    bad = []
    for req in requests:
        ids, why = req.prompt_ids, None
        if not ids:
            why = "empty prompt"
        elif vocab_size is not None and (min(ids) < 0 or max(ids) >= vocab_size):
            tok = next(t for t in ids if t < 0 or t >= vocab_size)
            why = f"token id {tok} outside the model's vocabulary [0, {vocab_size})"
        elif max_input_len is not None and len(ids) >= max_input_len:
            limit = max_input_len - 1
            why = f"{len(ids)} prompt tokens, the server's limit is {limit} (max_req_input_len {max_input_len})"
        if why:
            bad.append(f"{describe_request(req)}: {why}")
    if bad:
        more = f"\n  ... and {len(bad) - 10} more" if len(bad) > 10 else ""
        raise PromptError(f"{len(bad)} prompt(s) refused before generation:\n  " + "\n  ".join(bad[:10]) + more)


class Engine(Protocol):
    """What the rollout phase and the loops use of an engine. ``EngineBase`` gives the defaults a batch-at-a-time
    engine needs, so only engines that stream (SGLang) write ``submit`` and ``max_in_flight``."""

    name: str  # recorded in each stage manifest
    # Is every sample drawn from its seed alone, so that a resumed stage redraws exactly what an uninterrupted run
    # would? None: cannot tell. Recorded with each shard.
    deterministic: bool | None
    max_in_flight: int  # requests the phase keeps submitted at once; 0: it hands over whole shards to ``generate``

    def check_requests(self, requests: list[GenerateRequest]) -> None:
        """Raise PromptError naming every request the engine would refuse, before any work is done."""
        ...

    def generate(self, requests: list[GenerateRequest]) -> list[GeneratedSample]:
        """n samples per request, grouped by request, in request order."""
        ...

    def submit(self, index: int, request: GenerateRequest) -> Future:
        """One request; the future's result is its n samples (``index`` only labels it)."""
        ...

    def update_weights(self, hf_dir: str | None = None, state_dict: dict | None = None, *, version=None,
                       probe=None):
        """Serve new weights (a folder or HF-named tensors); an engine that can check them returns a report."""
        ...

    def begin_stage(self) -> None:
        """A rollout phase starts (per-server counts and restart budgets start anew)."""
        ...

    def server_stats(self) -> list[dict]:
        """Per server since ``begin_stage``: url, requests, samples, samples_per_s, restarts (none: [])."""
        ...

    def shutdown(self) -> None: ...


class EngineBase:
    """Defaults of the Engine protocol for an engine that generates a whole call at a time."""

    max_in_flight = 0
    deterministic: bool | None = None

    @property
    def name(self) -> str:
        return type(self).__name__

    def check_requests(self, requests: list[GenerateRequest]) -> None:
        check_prompts(requests, vocab_size=None, max_input_len=None)

    def submit(self, index: int, request: GenerateRequest) -> Future:
        """Runs the request now, in the caller's thread: there is nothing to overlap it with."""
        f: Future = Future()
        try:
            f.set_result(self.generate([request]))
        except Exception as e:
            f.set_exception(e)
        return f

    def generate(self, requests: list[GenerateRequest]) -> list[GeneratedSample]:
        raise NotImplementedError

    def update_weights(self, hf_dir: str | None = None, state_dict: dict | None = None, *, version=None,
                       probe=None):
        raise NotImplementedError(f"{self.name} cannot load new weights")

    def begin_stage(self) -> None:
        pass

    def server_stats(self) -> list[dict]:
        return []

    def shutdown(self) -> None:
        pass


def derive_seed(*parts: int) -> int:
    """A 63-bit seed that is a pure function of ``parts``, so results depend on identity, not on batching or order."""
    digest = hashlib.sha256("/".join(str(int(p)) for p in parts).encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def sample_seed(seed: int, prompt_id: int, sample_index: int) -> int:
    """The seed of one sample of a request: engines draw sample j of a request from this alone."""
    return derive_seed(seed, prompt_id, sample_index)
