"""The negative-advantage veto (NAV) of μ-GRPO: paper §3.3 (Eq. 3), §4, App. C.2 and D."""

from __future__ import annotations

import math

import torch

VETO_SCOPES = ("sequence", "suffix", "nontrigger_suffix", "trigger", "none")


@torch.no_grad()
def veto_mask(
    log_ratio: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    threshold: float | None,
    scope: str,
) -> torch.Tensor:
    """Return the tokens kept after the veto: bool [B, T], True = kept (always False outside ``response_mask``).

    A token is a *trigger* when its response has A < 0 and ρ_t = π_θ/β < τ (``threshold``); κ is the first trigger
    position (Eq. 3). Scopes, all applied only to A < 0 responses (§3.3):
      - "trigger"            T(y): drop the trigger tokens.
      - "suffix"             S_κ(y): drop every token after κ (κ itself kept; later triggers dropped).
      - "nontrigger_suffix"  H_κ(y) = S_κ \\ T: drop the non-trigger tokens after κ (App. D's harmful set).
      - "sequence"           S_seq(y): drop the whole response once any trigger exists (the paper's default, App. B).
      - "none"               keep everything.
    Dropped sets nest: S_seq ⊇ S_κ ⊇ H_κ. The test ρ < τ is done as log ρ < log τ, so it is exact for any log ρ.
    The mask is recomputed at every update and never differentiated through (§4).
    """
    if scope not in VETO_SCOPES:
        raise ValueError(f"unknown veto scope {scope!r}; expected one of {VETO_SCOPES}")
    mask = response_mask.bool()
    if scope == "none" or threshold is None or threshold <= 0:
        return mask.clone()
    negative = (advantages < 0).view(-1, 1)
    trigger = mask & negative & (log_ratio < math.log(threshold))
    triggers_so_far = torch.cumsum(trigger.to(torch.int32), dim=1)
    after_kappa = (triggers_so_far - trigger.to(torch.int32)) > 0  # t > κ: a trigger occurred strictly before t
    if scope == "trigger":
        drop = trigger
    elif scope == "suffix":
        drop = after_kappa
    elif scope == "nontrigger_suffix":
        drop = after_kappa & ~trigger
    else:  # sequence
        drop = trigger.any(dim=1, keepdim=True).expand_as(mask)
    return mask & ~drop
