"""Clipped policy-gradient surrogates for GRPO, μ-GRPO and M2PO (paper Eq. 2 and the J_μ-GRPO objective of §4), with
the KL and entropy regularisers of slime's and verl's recipes."""

from __future__ import annotations

import torch

from megamu.algo.config import AGGREGATIONS, AlgoConfig
from megamu.algo.kl import kl_estimate
from megamu.algo.veto import veto_mask


@torch.no_grad()
def m2po_mask(log_ratio: torch.Tensor, response_mask: torch.Tensor, threshold: float) -> torch.Tensor:
    """M2PO's second-moment trust region in its masking form: bool [B, T], True = kept.

    The tokens with the largest (log ρ)² are masked, largest first, until the second moment
    M2 = mean_{kept}(log ρ)² of the remaining response tokens is ≤ ``threshold`` (0.04 in the paper's baseline).
    Choices, stated because implementations differ: the mean is normalised by the number of *kept* tokens, every
    response token is eligible (no trust-region-quadrant gate on the sign of A), and M2 is computed per call, i.e. per
    micro-batch when the caller splits a minibatch.
    """
    mask = response_mask.bool()
    sq = torch.where(mask, log_ratio.detach().float() ** 2, torch.zeros((), dtype=torch.float32))
    flat = sq[mask]
    n = flat.numel()
    if n == 0 or flat.mean() <= threshold:
        return mask.clone()
    ordered, order = torch.sort(flat, descending=True)
    removed = torch.cat([torch.zeros(1), torch.cumsum(ordered, 0)[:-1]])  # sum of the k largest, k = 0..n-1
    remaining = torch.arange(n, 0, -1, dtype=torch.float32)
    ok = (flat.sum() - removed) / remaining <= threshold
    k = int(torch.nonzero(ok)[0]) if bool(ok.any()) else n
    keep_flat = torch.ones(n, dtype=torch.bool)
    keep_flat[order[:k]] = False
    out = mask.clone()
    out[mask] = keep_flat
    return out


def aggregate(per_token: torch.Tensor, response_mask: torch.Tensor, aggregation: str) -> torch.Tensor:
    """Reduce a per-token loss [B, T] (already zero where masked) to a scalar.

    Denominators count every response token and every sequence of the call, whatever the veto/clip did, as in
    J_μ-GRPO (§4: 1/|B| Σ 1/T Σ m_t ...). That makes the loss of a minibatch an exact weighted sum of the losses of
    its micro-batches: weights n_seq/N_seq for the seq-mean modes, n_tok/N_tok for token-mean.
    """
    mask = response_mask.to(per_token.dtype)
    if aggregation == "seq-mean-token-mean":
        lengths = mask.sum(dim=1).clamp(min=1)
        return ((per_token * mask).sum(dim=1) / lengths).mean()
    if aggregation == "token-mean":
        return (per_token * mask).sum() / mask.sum().clamp(min=1)
    if aggregation == "seq-mean-token-sum":
        return (per_token * mask).sum(dim=1).mean()
    raise ValueError(f"unknown aggregation {aggregation!r}; expected one of {AGGREGATIONS}")


def policy_loss(
    logp: torch.Tensor,
    behaviour_logp: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    algo: AlgoConfig,
    *,
    ref_logp: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The negated clipped surrogate −J, plus the regularisers ``algo`` turns on, and its diagnostics.

    ρ_t = exp(logp − behaviour_logp); per token −min(ρ_t A, clip(ρ_t, 1 − clip_low, 1 + clip_high) A) (Eq. 2), with A
    the response's advantage [B] and every setting from ``algo``. ``clip_ratio_c`` = c adds dual-clip (Ye et al. 2020,
    arXiv 1912.09729, as verl's ``compute_policy_loss_vanilla`` and slime's ``--eps-clip-c``): for A < 0 the token's
    loss is min(c·|A|, −min(ρ_t A, clip(ρ_t) A)), so a token whose ratio exceeds c has no gradient. GRPO: clip_low =
    clip_high = 0.2. μ-GRPO: clip_low = 1, clip_high = 4 (range [0, 5]) plus the negative-advantage veto (τ = 1e-4, see
    ``veto_mask``); under that range an A < 0 token with ρ ∈ (0, 5) has ∂loss/∂logπ = |A| ρ (§3.2). ``clip_high=None``
    removes the upper bound; ``m2po_threshold`` enables the M2PO mask (see ``m2po_mask``). Masks are computed without
    gradient.

    loss = pg_loss + kl_coef x agg(kl(logp, ref_logp)) − entropy_coef x agg(entropy), every term aggregated over all
    response tokens with ``algo.aggregation`` (veto and clip act on the surrogate only), as slime's
    ``policy_loss_function`` (slime/backends/megatron_utils/loss.py) and verl's dp_actor combine them. ``ref_logp``
    [B, T]: the reference policy's log-probs (needed when ``algo.uses_reference``); ``entropy`` [B, T]: the policy's
    per-token entropy (needed when ``algo.entropy_coef`` != 0; differentiable for the bonus to train).

    Returns (loss, stats); stats are detached floats: clip_fraction (response tokens whose clipped branch is active,
    i.e. zero gradient), dual_clip_fraction (A < 0 tokens with ρ > c: dual-clip's bound active, 0 when off),
    veto_token_fraction, veto_sequence_fraction, m2po_mask_fraction, ratio_mean, ratio_neg_adv_mean (E[ρ | A < 0], the
    collapse signal of §3.2, NaN when no A < 0 token), log_ratio_min, approx_kl (k3 estimate of KL(β ‖ π_θ) on β's
    samples: E[ρ − 1 − log ρ]), the loss's terms pg_loss, kl_loss (when ``ref_logp`` is given) and entropy_loss
    (agg(entropy), when ``entropy`` is given), each as aggregated (weighted like the loss across micro-batches), and the
    counts n_tokens, n_sequences, n_neg_adv_tokens that callers need to average stats over micro-batches.
    """
    if algo.uses_reference and ref_logp is None:
        raise ValueError(f"algorithm {algo.name!r} has a KL term (kl_coef={algo.kl_coef}): policy_loss needs ref_logp")
    if algo.entropy_coef and entropy is None:
        raise ValueError(f"algorithm {algo.name!r} has an entropy term (entropy_coef={algo.entropy_coef}): "
                         "policy_loss needs entropy")
    mask = response_mask.bool()
    dtype = torch.promote_types(logp.dtype, torch.float32)  # bf16 inputs are computed in fp32, fp64 stays fp64
    log_ratio = (logp.to(dtype) - behaviour_logp.to(dtype)).masked_fill(~mask, 0.0)
    ratio = torch.exp(log_ratio)
    adv = advantages.to(dtype).view(-1, 1)
    low = 1.0 - algo.clip_low
    high = float("inf") if algo.clip_high is None else 1.0 + algo.clip_high
    surrogate = torch.minimum(ratio * adv, torch.clamp(ratio, low, high) * adv)
    if algo.clip_ratio_c is not None:  # dual-clip: an A < 0 token's surrogate is at least c·A
        surrogate = torch.where(adv < 0, torch.maximum(surrogate, algo.clip_ratio_c * adv), surrogate)

    keep = veto_mask(log_ratio, advantages, mask, algo.veto_threshold, algo.veto_scope) \
        if algo.veto_threshold else mask.clone()
    after_veto = keep.clone()
    if algo.m2po_threshold is not None:
        keep &= m2po_mask(log_ratio, after_veto, algo.m2po_threshold)
    per_token = -surrogate * keep
    pg_loss = aggregate(per_token, mask, algo.aggregation)
    loss = pg_loss
    terms = {"pg_loss": float(pg_loss.detach())}
    if ref_logp is not None:
        kl_loss = aggregate(kl_estimate(logp, ref_logp, algo.kl_type).masked_fill(~mask, 0.0), mask, algo.aggregation)
        terms["kl_loss"] = float(kl_loss.detach())
        if algo.uses_reference:
            loss = loss + algo.kl_coef * kl_loss
    if entropy is not None:
        entropy_loss = aggregate(entropy.to(dtype).masked_fill(~mask, 0.0), mask, algo.aggregation)
        terms["entropy_loss"] = float(entropy_loss.detach())
        if algo.entropy_coef:
            loss = loss - algo.entropy_coef * entropy_loss

    with torch.no_grad():
        n_tok = int(mask.sum())
        denom = max(n_tok, 1)
        seq_has_tokens = mask.any(dim=1)
        neg = mask & (adv < 0)
        clipped = mask & (((ratio < low) & (adv < 0)) | ((ratio > high) & (adv > 0)))
        dual = mask & (adv < 0) & (ratio > algo.clip_ratio_c) if algo.clip_ratio_c is not None \
            else torch.zeros_like(mask)
        vetoed = mask & ~after_veto
        stats = {
            "clip_fraction": float(clipped.sum()) / denom,
            "dual_clip_fraction": float(dual.sum()) / denom,
            "veto_token_fraction": float(vetoed.sum()) / denom,
            "veto_sequence_fraction": float(vetoed.any(dim=1).sum()) / max(int(seq_has_tokens.sum()), 1),
            "m2po_mask_fraction": float((after_veto & ~keep).sum()) / denom,
            "ratio_mean": float(ratio[mask].mean()) if n_tok else float("nan"),
            "ratio_neg_adv_mean": float(ratio[neg].mean()) if bool(neg.any()) else float("nan"),
            "log_ratio_min": float(log_ratio[mask].min()) if n_tok else float("nan"),
            "approx_kl": float((ratio - 1 - log_ratio)[mask].mean()) if n_tok else float("nan"),
            **terms,
            "n_tokens": float(n_tok),
            "n_sequences": float(logp.shape[0]),
            "n_neg_adv_tokens": float(neg.sum()),
        }
    return loss, stats
