"""Rollout samples -> model input rows, scored positions, micro-batches and data-parallel shares.

Response frame: every per-token tensor is [n_samples, width] with column t = response token t (width = the longest
response), whatever the rows the model reads look like. Two row layouts:

- one sample per row: prompt + response, right-padded, causal. Response token t of a sample whose prompt has P
  tokens is predicted at position P - 1 + t.
- ``share_prompts``: consecutive samples with the same prompt (a group) share one row, prompt first, then each
  response (without its last token, which predicts nothing): [prompt | r_1[:-1] | r_2[:-1] | ...]. An attention mask
  lets each response see the prompt and its own earlier tokens only, so every token sees exactly what it sees in its
  own row above and log-probs and gradients are the same; the prompt is forwarded once per group instead of G times.
  Response token 0 of every sample is predicted at the prompt's last position.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megamu.rollout.records import RolloutSample

PAD_ID = 0  # any valid id: padded positions are never attended to by real tokens and never scored


@dataclass
class PackedBatch:
    input_ids: torch.Tensor  # [rows, s] int64: what the model reads
    attention_mask: torch.Tensor | None  # [rows, 1, s, s] bool, True = masked (shared prompts); None = causal rows
    score_index: torch.Tensor  # [n, width] int64: flat position (row * s + column) that predicts targets[i, t]
    targets: torch.Tensor  # [n, width] int64: response tokens, PAD_ID outside the response
    response_mask: torch.Tensor  # [n, width] bool, True on response tokens
    behaviour_logp: torch.Tensor  # [n, width] float32, 0 outside the response
    advantages: torch.Tensor  # [n] float32
    ref_logp: torch.Tensor | None = None  # [n, width] float32, 0 outside the response; None: no reference scored

    @property
    def n_sequences(self) -> int:
        return self.response_mask.shape[0]

    @property
    def n_tokens(self) -> int:
        return int(self.response_mask.sum())

    def to(self, device: torch.device | str) -> PackedBatch:
        mask = None if self.attention_mask is None else self.attention_mask.to(device)
        return PackedBatch(
            self.input_ids.to(device), mask, self.score_index.to(device), self.targets.to(device),
            self.response_mask.to(device), self.behaviour_logp.to(device), self.advantages.to(device),
            None if self.ref_logp is None else self.ref_logp.to(device),
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
    if sample.ref_logprobs is not None and len(sample.ref_logprobs) != len(sample.response_ids):
        raise ValueError(f"{where} has {len(sample.ref_logprobs)} reference log-probs for "
                         f"{len(sample.response_ids)} response tokens; they must match one to one")


def prompt_groups(samples: list[RolloutSample]) -> list[list[RolloutSample]]:
    """Runs of consecutive samples with the same prompt (same id and tokens): one shared row each."""
    runs: list[list[RolloutSample]] = []
    for s in samples:
        if runs and runs[-1][0].prompt_id == s.prompt_id and runs[-1][0].prompt_ids == s.prompt_ids:
            runs[-1].append(s)
        else:
            runs.append([s])
    return runs


def row_lengths(samples: list[RolloutSample], share_prompts: bool) -> list[int]:
    """Tokens of each row ``pack`` makes of ``samples``."""
    if not share_prompts:
        return [len(s.prompt_ids) + len(s.response_ids) for s in samples]
    return [len(g[0].prompt_ids) + sum(max(len(s.response_ids) - 1, 0) for s in g) for g in prompt_groups(samples)]


def pack(samples: list[RolloutSample], share_prompts: bool = False) -> PackedBatch:
    """Rows, scored positions and the response frame of ``samples`` (see the module docstring for the layouts)."""
    if not samples:
        raise ValueError("pack() needs at least one rollout sample")
    for s in samples:
        _check(s)
    rows = prompt_groups(samples) if share_prompts else [[s] for s in samples]
    seq_len = max(row_lengths(samples, share_prompts))
    n, width = len(samples), max(max(len(s.response_ids) for s in samples), 1)
    input_ids = torch.full((len(rows), seq_len), PAD_ID, dtype=torch.long)
    visible = torch.zeros((len(rows), seq_len, seq_len), dtype=torch.bool) if share_prompts else None
    index = torch.zeros((n, width), dtype=torch.long)
    targets = torch.full((n, width), PAD_ID, dtype=torch.long)
    mask = torch.zeros((n, width), dtype=torch.bool)
    behaviour = torch.zeros((n, width), dtype=torch.float32)
    with_ref = [s.ref_logprobs is not None for s in samples]
    if any(with_ref) and not all(with_ref):
        raise ValueError("pack(): some samples carry reference log-probs and some do not")
    ref = torch.zeros((n, width), dtype=torch.float32) if all(with_ref) else None
    i = 0
    for row, group in enumerate(rows):
        p = len(group[0].prompt_ids)
        base = row * seq_len
        input_ids[row, :p] = torch.tensor(group[0].prompt_ids, dtype=torch.long)
        if visible is not None:
            visible[row, :p, :p] = torch.ones(p, p, dtype=torch.bool).tril()
        end = p  # where the next response's inputs go (shared rows)
        for s in group:
            r = len(s.response_ids)
            response = torch.tensor(s.response_ids, dtype=torch.long)
            if visible is None:
                input_ids[row, p : p + r] = response
                index[i, :r] = base + p - 1 + torch.arange(r)
            else:
                k = max(r - 1, 0)  # inputs r_0 .. r_(r-2): the last token predicts nothing
                input_ids[row, end : end + k] = response[:k]
                visible[row, end : end + k, :p] = True
                visible[row, end : end + k, end : end + k] = torch.ones(k, k, dtype=torch.bool).tril()
                index[i, :r] = base + torch.cat((torch.tensor([p - 1]), end + torch.arange(k)))[:r]
                end += k
            targets[i, :r] = response
            mask[i, :r] = True
            behaviour[i, :r] = torch.tensor(s.behaviour_logprobs, dtype=torch.float32)
            if ref is not None:
                ref[i, :r] = torch.tensor(s.ref_logprobs, dtype=torch.float32)
            i += 1
        if visible is not None:  # padding sees itself only: no empty softmax row (its output is never read)
            pad = torch.arange(end, seq_len)
            visible[row, pad, pad] = True
    advantages = torch.tensor([s.advantage for s in samples], dtype=torch.float32)
    attention_mask = None if visible is None else ~visible[:, None]
    return PackedBatch(input_ids, attention_mask, index, targets, mask, behaviour, advantages, ref)


def unpack_response(values: torch.Tensor, batch: PackedBatch) -> list[list[float]]:
    """Per-sample response values (e.g. log-probs) from a [b, width] tensor in the batch's frame."""
    rows = values.detach().float().cpu()
    mask = batch.response_mask.cpu()
    return [rows[i][mask[i]].tolist() for i in range(rows.shape[0])]


def split_micro_batches(
    samples: list[RolloutSample], micro_batch_size: int, max_tokens_per_micro_batch: int | None = None,
    share_prompts: bool = False,
) -> list[list[RolloutSample]]:
    """Consecutive micro-batches of at most ``micro_batch_size`` samples and, when given, at most
    ``max_tokens_per_micro_batch`` padded tokens (rows x longest row as ``pack`` lays them out), the quantity
    activation memory follows. A single sample over the budget still gets a micro-batch of its own."""
    if micro_batch_size < 1:
        raise ValueError(f"--micro-batch-size must be >= 1, got {micro_batch_size}")
    if max_tokens_per_micro_batch is not None and max_tokens_per_micro_batch < 1:
        raise ValueError(f"--max-tokens-per-micro-batch must be >= 1, got {max_tokens_per_micro_batch}")

    def padded_tokens(mb: list[RolloutSample]) -> int:
        lengths = row_lengths(mb, share_prompts)
        return len(lengths) * max(lengths)

    out: list[list[RolloutSample]] = []
    current: list[RolloutSample] = []
    for s in samples:
        budget = max_tokens_per_micro_batch
        over_budget = budget is not None and padded_tokens([*current, s]) > budget
        if current and (len(current) == micro_batch_size or over_budget):
            out.append(current)
            current = []
        current.append(s)
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
