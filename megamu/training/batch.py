"""Rollout samples -> right-padded tensors, micro-batches and data-parallel shares.

Frame: ``forward_logprobs`` returns log π(input_ids[:, j+1]) at column j, so response token t of a sample whose prompt
has P tokens sits at column P - 1 + t. A packed batch keeps only the columns from the first one that holds any response
token (``first_column``), so the prompt-only columns never reach the loss.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megamu.records import RolloutSample

PAD_ID = 0  # any valid id: padded positions are never attended to by real tokens (causal) and never scored


@dataclass
class PackedBatch:
    input_ids: torch.Tensor  # [b, s] int64, prompt + response, right-padded
    response_mask: torch.Tensor  # [b, s - 1 - first_column] bool, True on response tokens
    behaviour_logp: torch.Tensor  # same shape, float32, 0 outside the response
    advantages: torch.Tensor  # [b] float32
    first_column: int  # column of the shifted [b, s - 1] log-prob frame where the tensors above start

    @property
    def n_sequences(self) -> int:
        return self.input_ids.shape[0]

    @property
    def n_tokens(self) -> int:
        return int(self.response_mask.sum())

    def to(self, device: torch.device | str) -> PackedBatch:
        return PackedBatch(
            self.input_ids.to(device), self.response_mask.to(device), self.behaviour_logp.to(device),
            self.advantages.to(device), self.first_column,
        )


def _check(sample: RolloutSample) -> None:
    where = f"rollout sample (prompt_id={sample.prompt_id}, sample_index={sample.sample_index})"
    if not sample.prompt_ids:
        raise ValueError(f"{where} has an empty prompt: the first response token has no context to be scored in")
    if len(sample.behaviour_logprobs) != len(sample.response_ids):
        raise ValueError(
            f"{where} has {len(sample.behaviour_logprobs)} behaviour log-probs for {len(sample.response_ids)} "
            "response tokens; they must match one to one"
        )


def pack(samples: list[RolloutSample]) -> PackedBatch:
    """Right-pad ``samples`` into one batch (see the module docstring for the column frame)."""
    if not samples:
        raise ValueError("pack() needs at least one rollout sample")
    for s in samples:
        _check(s)
    seq_len = max(len(s.prompt_ids) + len(s.response_ids) for s in samples)
    first = min(len(s.prompt_ids) for s in samples) - 1
    width = seq_len - 1 - first
    b = len(samples)
    input_ids = torch.full((b, seq_len), PAD_ID, dtype=torch.long)
    mask = torch.zeros((b, width), dtype=torch.bool)
    behaviour = torch.zeros((b, width), dtype=torch.float32)
    for i, s in enumerate(samples):
        p, r = len(s.prompt_ids), len(s.response_ids)
        input_ids[i, : p + r] = torch.tensor(s.prompt_ids + s.response_ids, dtype=torch.long)
        start = p - 1 - first
        mask[i, start : start + r] = True
        behaviour[i, start : start + r] = torch.tensor(s.behaviour_logprobs, dtype=torch.float32)
    advantages = torch.tensor([s.advantage for s in samples], dtype=torch.float32)
    return PackedBatch(input_ids, mask, behaviour, advantages, first)


def unpack_response(values: torch.Tensor, batch: PackedBatch) -> list[list[float]]:
    """Per-sample response values (e.g. log-probs) from a [b, width] tensor in the batch's frame."""
    rows = values.detach().float().cpu()
    mask = batch.response_mask.cpu()
    return [rows[i][mask[i]].tolist() for i in range(rows.shape[0])]


def split_micro_batches(
    samples: list[RolloutSample], micro_batch_size: int, max_tokens_per_micro_batch: int | None = None
) -> list[list[RolloutSample]]:
    """Consecutive micro-batches of at most ``micro_batch_size`` samples and, when given, at most
    ``max_tokens_per_micro_batch`` padded tokens (rows x longest prompt+response), the quantity activation memory
    follows. A single sample over the budget still gets a micro-batch of its own."""
    if micro_batch_size < 1:
        raise ValueError(f"--micro-batch-size must be >= 1, got {micro_batch_size}")
    if max_tokens_per_micro_batch is not None and max_tokens_per_micro_batch < 1:
        raise ValueError(f"--max-tokens-per-micro-batch must be >= 1, got {max_tokens_per_micro_batch}")
    out: list[list[RolloutSample]] = []
    current: list[RolloutSample] = []
    longest = 0
    for s in samples:
        n = len(s.prompt_ids) + len(s.response_ids)
        grown = max(longest, n)
        over_budget = max_tokens_per_micro_batch is not None and grown * (len(current) + 1) > max_tokens_per_micro_batch
        if current and (len(current) == micro_batch_size or over_budget):
            out.append(current)
            current, grown = [], n
        current.append(s)
        longest = grown
    if current:
        out.append(current)
    return out


def data_parallel_bounds(samples: list[RolloutSample], size: int) -> list[int]:
    """Cut points [0, c_1, ..., n]: rank r takes samples[c_r : c_(r+1)], a contiguous share of the minibatch.

    Cuts fall on prompt-group boundaries (consecutive samples with the same ``prompt_id``) when there are at least
    ``size`` groups, at the boundary nearest to an even split; otherwise the samples are split evenly. The gradient does
    not depend on where the cuts fall (the loss scaling uses global counts); keeping groups together only keeps each
    group's statistics on one rank.
    """
    n = len(samples)
    group_ends = [i for i in range(1, n + 1) if i == n or samples[i].prompt_id != samples[i - 1].prompt_id]
    if size == 1 or len(group_ends) < size:
        return [(k * n) // size for k in range(size + 1)]
    cuts = [0]
    for k in range(1, size):
        options = [e for e in group_ends[:-1] if e > cuts[-1]]
        spare = size - 1 - k  # boundaries the later cuts still need
        options = options[: len(options) - spare]
        cuts.append(min(options, key=lambda e: (abs(e - k * n / size), e)))
    return cuts + [n]


def data_parallel_share(samples: list[RolloutSample], rank: int, size: int) -> list[RolloutSample]:
    cuts = data_parallel_bounds(samples, size)
    return list(samples[cuts[rank] : cuts[rank + 1]])
