"""Per-token KL estimators between the policy π_θ and a frozen reference policy π_ref, on the sampled tokens.

With log r = log π_θ(a_t) − log π_ref(a_t) (Schulman, "Approximating KL Divergence", joschu.net/blog/kl-approx.html):
  k1 = log r                       (unbiased for KL(π_θ ‖ π_ref) on π_θ's samples; can be negative)
  k2 = (log r)² / 2                (biased, ≥ 0)
  k3 = exp(−log r) − 1 + log r     (unbiased, ≥ 0, lower variance)
  low_var_kl = k3 clamped to [−10, 10]
The names and the clamp follow slime's ``compute_approx_kl`` (slime/utils/ppo_utils.py) and verl's ``kl_penalty``
(verl/trainer/ppo/core_algos.py, where "low_var_kl" is the clamped k3). The loss adds coef x aggregate(kl) with the
policy loss's own aggregation, as both do (slime: loss.py ``policy_loss_function``; verl: dp_actor's ``kl_loss``).
"""

from __future__ import annotations

import torch

KL_TYPES = ("k1", "k2", "k3", "low_var_kl")
LOW_VAR_KL_CLAMP = 10.0


def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str) -> torch.Tensor:
    """The per-token estimator ``kind`` (one of KL_TYPES) of KL(π_θ ‖ π_ref), same shape as ``logp``; computed in
    fp32 at least (bf16 inputs are promoted). Differentiable in ``logp``."""
    dtype = torch.promote_types(logp.dtype, torch.float32)
    log_ratio = logp.to(dtype) - ref_logp.to(dtype)
    if kind == "k1":
        return log_ratio
    if kind == "k2":
        return log_ratio**2 / 2
    if kind in ("k3", "low_var_kl"):
        k3 = torch.exp(-log_ratio) - 1 + log_ratio
        return k3.clamp(-LOW_VAR_KL_CLAMP, LOW_VAR_KL_CLAMP) if kind == "low_var_kl" else k3
    raise ValueError(f"unknown KL estimator {kind!r}; expected one of {KL_TYPES}")
