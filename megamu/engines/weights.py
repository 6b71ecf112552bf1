"""What an engine is given at a weight sync: a value the trainer makes and the loop hands over, never the policy.

The trainer's side (megamu.training.policy.Policy.weights) fills it collectively; the engines take it
(``Engine.update_weights``) without knowing where it came from, so nothing under megamu/engines or
megamu/rollout imports the trainer.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass(frozen=True)
class LogprobProbe:
    """A sequence and the trainer's teacher-forced log-probs of its tokens after the first, at temperature 1.

    After a sync the mean |difference| between the server's log-probs of the same tokens and these must be within
    ``tolerance`` (derive it from the dtype: bf16 keeps 8 bits of mantissa); weights of another model are off by
    ~1 nat. This is the stage-start ratio-1 check, made cheap."""

    token_ids: list[int]
    logprobs: list[float]  # len(token_ids) - 1 values: log p(token_ids[i] | token_ids[:i]) for i >= 1
    tolerance: float


@dataclass(frozen=True)
class Weights:
    """Policy weights at one version, as an HF folder (an engine can start from it or reload it), as HF-named tensors
    (an in-memory push), or both; with an optional probe that the engine's log-probs must match after the push."""

    version: int  # optimiser updates behind these weights: the policy version of the samples they generate
    hf_dir: Path | None = None
    # full HF-named tensors in the export dtype; on global rank 0 (on every rank for per-rank pushes)
    tensors: dict[str, torch.Tensor] | None = None
    probe: LogprobProbe | None = None
