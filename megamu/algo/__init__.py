"""μ-GRPO's algorithm core: pure torch, no Megatron, no I/O. Equation numbers refer to arXiv 2605.17570."""

from megamu.algo.advantages import ADVANTAGE_EPS, group_advantages
from megamu.algo.config import AGGREGATIONS, ALGORITHM_PRESETS, AlgoConfig
from megamu.algo.kl import KL_TYPES, kl_estimate
from megamu.algo.loss import aggregate, m2po_mask, policy_loss
from megamu.algo.tail import REFERENCE_TAU, lower_tail_stats, neg_adv_log_ratios
from megamu.algo.veto import VETO_SCOPES, veto_mask

__all__ = [
    "ADVANTAGE_EPS",
    "AGGREGATIONS",
    "ALGORITHM_PRESETS",
    "KL_TYPES",
    "REFERENCE_TAU",
    "VETO_SCOPES",
    "AlgoConfig",
    "aggregate",
    "group_advantages",
    "kl_estimate",
    "lower_tail_stats",
    "m2po_mask",
    "neg_adv_log_ratios",
    "policy_loss",
    "veto_mask",
]
