"""The engine protocol: what every rollout engine (in-process or SGLang) takes and returns."""

from __future__ import annotations

import hashlib
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


@dataclass
class GeneratedSample:
    prompt_id: int
    sample_index: int
    output_ids: list[int]  # includes the stop/EOS token when finish_reason == "stop"
    output_logprobs: list[float]  # one per output id
    finish_reason: str  # "stop" | "length" | "abort"


class Engine(Protocol):
    def generate(self, requests: list[GenerateRequest]) -> list[GeneratedSample]:
        """n samples per request, grouped by request, in request order."""
        ...

    def update_weights(self, hf_dir: str | None = None, state_dict: dict | None = None) -> None: ...

    def shutdown(self) -> None: ...


def derive_seed(*parts: int) -> int:
    """A 63-bit seed that is a pure function of ``parts``, so results depend on identity, not on batching or order."""
    digest = hashlib.sha256("/".join(str(int(p)) for p in parts).encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def sample_seed(seed: int, prompt_id: int, sample_index: int) -> int:
    """The seed of one sample of a request: engines draw sample j of a request from this alone."""
    return derive_seed(seed, prompt_id, sample_index)
