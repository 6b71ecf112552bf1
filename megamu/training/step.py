"""One optimiser update on one minibatch, split over data-parallel ranks and micro-batches.

Loss scaling: ``policy_loss`` over a micro-batch is a mean over its sequences (seq-mean modes) or its response tokens
(token-mean), with denominators that count every row / response token whatever the veto does. Multiplying it by
n_seq(micro) / N_seq(minibatch), resp. n_tok(micro) / N_tok(minibatch), and SUMMING gradients over micro-batches and
data-parallel ranks therefore gives exactly the gradient of ``policy_loss`` over the whole minibatch in one call.
Every rank receives the whole minibatch, so the global counts need no communication.

Exception: M2PO's mask (``m2po_threshold``) is defined per ``policy_loss`` call, so with it the update depends on the
micro-batch split (see ``megamu.algo.loss.m2po_mask``).
"""

from __future__ import annotations

import math
import time

import torch
import torch.distributed as dist

from megamu.algo import REFERENCE_TAU, AlgoConfig, lower_tail_stats, neg_adv_log_ratios, policy_loss
from megamu.model import score_tokens
from megamu.model.config import scale_router_aux_loss
from megamu.rollout.records import RolloutSample
from megamu.runtime import parallel
from megamu.training.batch import (
    PackedBatch,
    data_parallel_bounds,
    data_parallel_share,
    pack,
    prompt_groups,
    row_lengths,
    split_micro_batches,
    unpack_response,
)

# policy_loss stats that are means over response tokens (re-weighted by token counts across micro-batches and ranks)
TOKEN_STATS = ("clip_fraction", "dual_clip_fraction", "veto_token_fraction", "m2po_mask_fraction", "ratio_mean",
               "approx_kl")
# policy_loss's terms: aggregated like the loss, so weighted like it (exact over the minibatch)
LOSS_TERMS = ("pg_loss", "kl_loss", "entropy_loss")


def response_logprobs(
    model, batch: PackedBatch, *, temperature: float = 1.0, with_entropy: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (and entropy) of the batch's response tokens, in its response frame [n, width] (0 outside the
    responses): ``score_tokens`` on the batch's rows, with the output layer applied at the response tokens only."""
    return score_tokens(model, batch.input_ids, batch.score_index, batch.targets, attention_mask=batch.attention_mask,
                        temperature=temperature, with_entropy=with_entropy, scored=batch.response_mask)


def length_order(samples: list[RolloutSample], share_prompts: bool) -> list[int]:
    """Indices of ``samples`` by row length, so that rows of similar length share a micro-batch (less padding).
    With shared prompts a group's samples stay together, in their order, as they share one row."""
    if not share_prompts:
        return sorted(range(len(samples)), key=lambda i: len(samples[i].prompt_ids) + samples[i].response_length)
    runs, start = [], 0
    for group in prompt_groups(samples):
        runs.append((row_lengths(group, True)[0], range(start, start + len(group))))
        start += len(group)
    return [i for _, run in sorted(runs, key=lambda r: r[0]) for i in run]


def _device(model) -> torch.device:
    return next(model.parameters()).device


def train_step(
    model,
    optimizer,
    samples: list[RolloutSample],
    algo: AlgoConfig,
    *,
    micro_batch_size: int,
    max_tokens_per_micro_batch: int | None = None,
    temperature: float = 1.0,
    skip_zero_advantage: bool = False,
    share_prompts: bool = False,
) -> dict[str, float]:
    """One update on the minibatch ``samples`` (the same list on every rank). Returns metrics for the minibatch.

    ``skip_zero_advantage``: samples with A = 0 (groups whose rewards are all equal) contribute exactly zero loss and
    gradient, so their forward/backward can be skipped without changing the update; the denominators still count them.
    Not with a KL or entropy term, which A = 0 samples carry too: then every sample is trained.
    Token statistics (ratio, entropy, clip/veto fractions) are then over the trained samples only, and M2PO's
    per-call second moment excludes them.
    """
    if not samples:
        raise ValueError("train_step needs a non-empty minibatch")
    start = time.perf_counter()
    device = _device(model)
    seq_mode = algo.aggregation != "token-mean"
    n_seq = len(samples)
    n_tok = sum(s.response_length for s in samples)

    local = data_parallel_share(samples, parallel.dp_rank(), parallel.dp_size())
    if skip_zero_advantage and not (algo.uses_reference or algo.entropy_coef):  # those terms train A = 0 samples too
        local = [s for s in local if s.advantage != 0.0]
    # Shorter rows together waste less padding; the gradient is a sum over micro-batches, so the order is free.
    local = [local[i] for i in length_order(local, share_prompts)]
    micro_batches = (split_micro_batches(local, micro_batch_size, max_tokens_per_micro_batch, share_prompts)
                     if local else [])
    padding = parallel.ep_agreed_count(len(micro_batches), device) - len(micro_batches)

    sums = _MinibatchSums()
    optimizer.zero_grad()
    for mb in micro_batches:
        batch = pack(mb, share_prompts).to(device)
        logp, entropy = response_logprobs(model, batch, temperature=temperature, with_entropy=True)
        if not algo.entropy_coef:
            entropy = entropy.detach()  # a metric: dropping its graph now frees its vocab-sized temporaries
        if algo.uses_reference and batch.ref_logp is None:
            raise ValueError("the KL term needs the samples' reference log-probs (Policy.update scores them)")
        loss, st = policy_loss(logp, batch.behaviour_logp, batch.advantages, batch.response_mask, algo,
                               ref_logp=batch.ref_logp, entropy=entropy)
        weight = batch.n_sequences / n_seq if seq_mode else st["n_tokens"] / max(n_tok, 1)
        scale_router_aux_loss(weight)  # an MoE router's aux loss: weighted as this micro-batch's policy loss
        (loss * weight).backward()
        sums.add(batch, logp, entropy.detach(), loss, weight, st, row_tokens=sum(row_lengths(mb, share_prompts)))

    scale_router_aux_loss(0.0)  # the padding passes change nothing, their routers' aux loss included
    zero_weight_passes(model, samples, padding, device=device, temperature=temperature, share_prompts=share_prompts,
                       backward=True)
    grad_norm, lr = optimizer.step()
    t, log_ratio_min, tail = sums.reduced(device)
    elapsed = time.perf_counter() - start
    return {**_minibatch_metrics(t, log_ratio_min, tail, samples, algo), "grad_norm": grad_norm, "lr": lr,
            # every token of the minibatch (prompts included; skipped samples too), for the whole data-parallel group
            "tokens_per_s": sum(len(s.prompt_ids) + s.response_length for s in samples) / elapsed,
            "step_time_s": elapsed, "n_micro_batches": float(len(micro_batches))}


class _MinibatchSums:
    """This rank's sums over its micro-batches, all-reduced over data-parallel ranks once the step is done; the A < 0
    tokens' log ρ (and each reply's minimum) are kept whole, for a quantile, not a sum."""

    def __init__(self) -> None:
        self.sums = dict.fromkeys(("loss", "entropy", "tokens", "rows", "neg_tokens", "ratio_neg_adv", "read_tokens",
                                   "row_tokens", "veto_sequence_fraction", *TOKEN_STATS, *LOSS_TERMS), 0.0)
        self.log_ratio_min = math.inf
        self.tails: list[tuple[torch.Tensor, torch.Tensor]] = []

    def add(self, batch: PackedBatch, logp: torch.Tensor, entropy: torch.Tensor, loss: torch.Tensor, weight: float,
            st: dict, *, row_tokens: int) -> None:
        sums, mb_tok = self.sums, st["n_tokens"]
        self.tails.append(neg_adv_log_ratios(logp, batch.behaviour_logp, batch.advantages, batch.response_mask))
        rows = float(batch.response_mask.any(dim=1).sum())
        sums["read_tokens"] += batch.input_ids.numel()  # positions the model reads, padding included
        sums["row_tokens"] += row_tokens
        sums["loss"] += float(loss.detach()) * weight
        for k in LOSS_TERMS:
            sums[k] += st.get(k, 0.0) * weight
        sums["entropy"] += float((entropy * batch.response_mask).sum())
        sums["tokens"] += mb_tok
        sums["rows"] += rows
        for k in TOKEN_STATS:
            sums[k] += st[k] * mb_tok if mb_tok else 0.0
        sums["veto_sequence_fraction"] += st["veto_sequence_fraction"] * rows
        if st["n_neg_adv_tokens"]:
            sums["neg_tokens"] += st["n_neg_adv_tokens"]
            sums["ratio_neg_adv"] += st["ratio_neg_adv_mean"] * st["n_neg_adv_tokens"]
        if mb_tok:
            self.log_ratio_min = min(self.log_ratio_min, st["log_ratio_min"])

    def reduced(self, device: torch.device) -> tuple[dict[str, float], float, list[torch.Tensor]]:
        """The sums, the minimum log ρ and the lower tail over the whole data-parallel group."""
        keys = list(self.sums)
        totals = torch.tensor([self.sums[k] for k in keys], dtype=torch.float64, device=device)
        min_log_ratio = torch.tensor([self.log_ratio_min], dtype=torch.float64, device=device)
        if parallel.dp_size() > 1:
            dist.all_reduce(totals, group=parallel.dp_group())
            dist.all_reduce(min_log_ratio, op=dist.ReduceOp.MIN, group=parallel.dp_group())
        tail = [torch.cat([x[i].cpu() for x in self.tails]) if self.tails else torch.zeros(0, dtype=torch.float64)
                for i in (0, 1)]
        if parallel.dp_size() > 1:  # the whole minibatch's tail, not one rank's
            gathered: list = [None] * parallel.dp_size()
            dist.all_gather_object(gathered, [x.tolist() for x in tail], group=parallel.dp_group())
            tail = [torch.tensor([v for g in gathered for v in g[i]], dtype=torch.float64) for i in (0, 1)]
        return dict(zip(keys, totals.tolist())), float(min_log_ratio), tail


def _minibatch_metrics(t: dict[str, float], log_ratio_min: float, tail: list[torch.Tensor],
                       samples: list[RolloutSample], algo: AlgoConfig) -> dict[str, float]:
    """The update's record from the reduced sums ``t``: token statistics per token, reply statistics per reply."""

    def per(key: str, denom: float) -> float:
        return t[key] / denom if denom else float("nan")

    n_seq, n_tok = len(samples), sum(s.response_length for s in samples)
    rewards = torch.tensor([s.reward for s in samples], dtype=torch.float64)
    advantages = torch.tensor([s.advantage for s in samples], dtype=torch.float64)
    return {
        "loss": t["loss"],
        "pg_loss": t["pg_loss"],
        "entropy_loss": t["entropy_loss"],
        **({"kl_loss": t["kl_loss"]} if any(s.ref_logprobs is not None for s in samples) else {}),
        **{k: per(k, t["tokens"]) for k in TOKEN_STATS},
        "veto_sequence_fraction": per("veto_sequence_fraction", t["rows"]),
        "ratio_neg_adv_mean": per("ratio_neg_adv", t["neg_tokens"]),
        "log_ratio_min": log_ratio_min if math.isfinite(log_ratio_min) else float("nan"),
        **lower_tail_stats(*tail, algo.veto_threshold or REFERENCE_TAU),
        "entropy": per("entropy", t["tokens"]),
        "n_sequences": float(n_seq),
        "n_tokens": float(n_tok),
        "response_length_mean": n_tok / n_seq,
        "reward_mean": float(rewards.mean()),
        "advantage_mean": float(advantages.mean()),
        "advantage_std": float(advantages.std()) if n_seq > 1 else 0.0,
        "advantage_min": float(advantages.min()),
        "advantage_max": float(advantages.max()),
        # padded / read positions over the micro-batches forwarded (0 when none was: all skipped)
        "pad_fraction": 1.0 - t["row_tokens"] / t["read_tokens"] if t["read_tokens"] else 0.0,
        "trained_sample_fraction": t["rows"] / n_seq,
    }


def zero_weight_passes(model, samples: list[RolloutSample], count: int, *, device: torch.device, temperature: float,
                       share_prompts: bool, backward: bool) -> None:
    """``count`` forward (and backward) passes of the minibatch's shortest sample that change nothing: a rank whose
    share has fewer micro-batches than another of its expert-parallel group still enters each of the group's MoE
    collectives (``parallel.ep_agreed_count``). Their gradient is exactly zero and no statistic counts them."""
    if not count:
        return
    filler = min(samples, key=lambda s: len(s.prompt_ids) + s.response_length)
    batch = pack([filler], share_prompts).to(device)
    for _ in range(count):
        logp, _ = response_logprobs(model, batch, temperature=temperature)
        if backward:
            (logp.sum() * 0.0).backward()


@torch.no_grad()
def compute_logprobs(
    model, samples: list[RolloutSample], *, temperature: float = 1.0, micro_batch_size: int = 8,
    max_tokens_per_micro_batch: int | None = None, share_prompts: bool = False,
) -> list[list[float]]:
    """log π_θ of every response token of ``samples`` (same list on every rank), in order; DP ranks split the work.
    ``share_prompts`` as in ``train_step``."""
    device = _device(model)
    rank, size = parallel.dp_rank(), parallel.dp_size()
    cuts = data_parallel_bounds(samples, size)
    mine = range(cuts[rank], cuts[rank + 1])
    order = [mine[i] for i in length_order([samples[i] for i in mine], share_prompts)]
    results: dict[int, list[float]] = {}
    done = 0
    chunks = split_micro_batches([samples[i] for i in order], micro_batch_size, max_tokens_per_micro_batch,
                                 share_prompts) if order else []
    # Agreed before any pass: asked after them, a rank with fewer chunks sits in this all-reduce while another is
    # in its next pass's MoE all-gather/all-to-all, and both wait until the collective timeout (seen at EP 2).
    padding = parallel.ep_agreed_count(len(chunks), device) - len(chunks)
    for chunk in chunks:
        batch = pack(chunk, share_prompts).to(device)
        logp, _ = response_logprobs(model, batch, temperature=temperature)
        for i, values in zip(order[done : done + len(chunk)], unpack_response(logp, batch)):
            results[i] = values
        done += len(chunk)
    zero_weight_passes(model, samples, padding, device=device, temperature=temperature, share_prompts=share_prompts,
                       backward=False)
    if size > 1:
        gathered = parallel.all_gather_object(results, group=parallel.dp_group())
        results = {k: v for part in gathered for k, v in part.items()}
    return [results[i] for i in range(len(samples))]
