"""The lower tail of log ρ on negative-advantage tokens: the per-update view of the veto's trigger (paper §3.2-3.3).

§3.2: collapse is driven by A < 0 tokens whose ratio ρ = π_θ / β has fallen far below 1; μ-GRPO's veto (Eq. 3) fires
on an A < 0 reply as soon as one of its tokens has ρ < τ, i.e. min_t log ρ_t < log τ. The mean E[ρ | A < 0] hides
that tail, so the trainer also records its 10th percentile and the fraction of A < 0 replies the veto at τ would
trigger on (whether or not the run's method vetoes).
"""

from __future__ import annotations

import math

import torch

from megamu.algo.presets import PRESETS

# the τ the tail is read against when a method has no veto of its own: μ-GRPO's (App. B, 1e-4)
REFERENCE_TAU: float = PRESETS["mu-grpo"]["veto_threshold"]


@torch.no_grad()
def neg_adv_log_ratios(
    logp: torch.Tensor, behaviour_logp: torch.Tensor, advantages: torch.Tensor, response_mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """log ρ_t of every A < 0 response token (1-D), and min_t log ρ_t of every A < 0 reply with a response token
    (1-D), both in float64 so that tails gathered over micro-batches and ranks do not depend on the input dtype."""
    mask = response_mask.bool()
    log_ratio = logp.detach().double() - behaviour_logp.detach().double()
    neg = (advantages < 0).view(-1)
    rows = neg & mask.any(dim=1)
    tokens = log_ratio[mask & neg.view(-1, 1)]
    reply_min = log_ratio.masked_fill(~mask, math.inf).min(dim=1).values[rows]
    return tokens, reply_min


def lower_tail_stats(tokens: torch.Tensor, reply_min: torch.Tensor, tau: float, q: float = 0.1) -> dict[str, float]:
    """``neg_adv_log_ratio_p10``: the ``q`` quantile (linear interpolation) of the A < 0 tokens' log ρ;
    ``neg_adv_reply_below_tau``: the fraction of A < 0 replies with min log ρ < log τ (the veto's trigger test,
    Eq. 3). NaN when there is no A < 0 token / reply."""
    return {
        "neg_adv_log_ratio_p10": float(torch.quantile(tokens.double(), q)) if tokens.numel() else math.nan,
        "neg_adv_reply_below_tau": float((reply_min < math.log(tau)).double().mean()) if reply_min.numel()
        else math.nan,
    }
