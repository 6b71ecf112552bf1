"""Rewards: math answer checking (math-verify) and a pool that runs any fn(response, ground_truth) -> float."""

from megamu.reward.math import extract_boxed, math_score, verify_answer
from megamu.reward.pool import DEFAULT_REWARD_FN, RewardScorer, load_reward_fn, score_batch

__all__ = [
    "DEFAULT_REWARD_FN",
    "RewardScorer",
    "extract_boxed",
    "load_reward_fn",
    "math_score",
    "score_batch",
    "verify_answer",
]
