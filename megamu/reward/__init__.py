"""Rewards: math answer checking (math-verify), sandboxed code tests, and a pool that runs any
fn(response, ground_truth) -> float. ``make_scorer(RewardConfig)`` picks the reward of a run."""

from megamu.reward.config import REWARD_KINDS, RewardConfig, make_scorer
from megamu.reward.math import extract_boxed, math_score, verify_answer
from megamu.reward.pool import DEFAULT_REWARD_FN, RewardScorer, load_reward_fn, score_batch

__all__ = [
    "DEFAULT_REWARD_FN",
    "REWARD_KINDS",
    "RewardConfig",
    "RewardScorer",
    "extract_boxed",
    "load_reward_fn",
    "make_scorer",
    "math_score",
    "score_batch",
    "verify_answer",
]
