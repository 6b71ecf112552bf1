"""DAPO's reward shaping and group filter (Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement Learning System
at Scale", arXiv 2503.14476), pure torch. Its other two parts are settings of the loss: the decoupled clip
("clip-higher", ε_low = 0.2, ε_high = 0.28) and token-level aggregation (``token-mean``); see the "dapo" preset.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def overlong_penalty(lengths: torch.Tensor, max_len: int, buffer: int, factor: float = 1.0) -> torch.Tensor:
    """DAPO's soft overlong punishment (§3.4, Eq. 13) per response, added to its reward:

        0                                  if |y| ≤ L_max − L_cache
        factor · ((L_max − L_cache) − |y|) / L_cache   if L_max − L_cache < |y| ≤ L_max
        −factor                            if |y| > L_max

    with L_max = ``max_len`` (the rollout's response limit) and L_cache = ``buffer``. verl computes the same in its
    DAPO reward manager (verl/workers/reward_manager/dapo.py: min(−(len − expected_len) / buffer · factor, 0), where
    a reply never exceeds the limit). ``lengths``: response token counts [n]; returns float64 [n]."""
    if not 0 < buffer < max_len:
        raise ValueError(f"the overlong buffer must be in (0, {max_len}) tokens (the response limit), got {buffer}")
    length = lengths.to(torch.float64)
    start = max_len - buffer
    inside = (start - length) / buffer * factor
    penalty = torch.where(length <= start, torch.zeros_like(length), inside)
    return torch.where(length > max_len, torch.full_like(length, -factor), penalty)


# What dynamic sampling compares within a group: verl's algorithm.filter_groups.metric (recipe/dapo/dapo_ray_trainer.py
# ``fit``): "acc", the reward function's own score (verl: its "acc" extra, correctness), or "seq_reward", the reward
# trained on (the score plus the overlong penalty; verl's token_level_scores summed)
FILTER_METRICS = ("acc", "seq_reward")


def filter_values(rewards: torch.Tensor, penalties: torch.Tensor, metric: str) -> torch.Tensor:
    """The values of ``metric`` (FILTER_METRICS) for rewards [n_groups, G] that carry the overlong ``penalties``
    (same shape; zeros without the punishment). "acc" takes the penalty off again, rounded to 1e-9 so that a score
    r compares equal to (r + p) − p; "seq_reward" is the reward as trained on."""
    if metric == "seq_reward":
        return rewards
    if metric == "acc":
        return torch.round((rewards - penalties) * 1e9) / 1e9
    raise ValueError(f"unknown filter metric {metric!r}; expected one of {FILTER_METRICS}")


def informative_groups(rewards: torch.Tensor) -> torch.Tensor:
    """DAPO's dynamic sampling filter (§3.2, Eq. 11: 0 < |{o_i correct}| < G): bool [n_groups], True where a group's
    rewards are not all equal, i.e. its Eq. 1 advantages are not all zero. Generalised from accuracy to any reward as
    verl's ``filter_groups`` does (metric: the std of the group's values > 0, recipe/dapo/dapo_ray_trainer.py)."""
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [n_groups, G], got shape {tuple(rewards.shape)}")
    return (rewards != rewards[:, :1]).any(dim=1)


@dataclass(frozen=True)
class OverlongShaping:
    """The soft overlong punishment of one rollout: its response limit (``max_len`` tokens), the buffer and factor."""

    max_len: int
    buffer: int
    factor: float = 1.0

    def penalties(self, lengths: list[int]) -> list[float]:
        return overlong_penalty(torch.tensor(lengths), self.max_len, self.buffer, self.factor).tolist()

    def punished(self, length: int) -> bool:
        return length > self.max_len - self.buffer
