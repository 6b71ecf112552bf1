"""Group-relative advantages (paper Eq. 1)."""

from __future__ import annotations

import torch

ADVANTAGE_EPS = 1e-6


def group_advantages(rewards: torch.Tensor, normalize_std: bool = True, eps: float = ADVANTAGE_EPS) -> torch.Tensor:
    """A_i = (R_i − mean_g R) / (std_g R + eps), Eq. 1 of the paper, computed per prompt group.

    rewards: [n_groups, G]. std is the unbiased sample std (torch's default, as in verl's GRPO); ``eps`` only guards
    the division. Groups whose rewards are all equal (std == 0), and groups of size 1, carry no learning signal: their
    advantages are exactly 0. ``normalize_std=False`` gives the mean-centred variant (Dr. GRPO style).
    """
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [n_groups, G], got shape {tuple(rewards.shape)}")
    r = rewards.to(torch.float32)
    centred = r - r.mean(dim=1, keepdim=True)
    if r.shape[1] < 2:
        return torch.zeros_like(r)
    std = r.std(dim=1, keepdim=True)
    degenerate = std == 0
    if normalize_std:
        centred = centred / (std + eps)
    return torch.where(degenerate, torch.zeros_like(centred), centred)
