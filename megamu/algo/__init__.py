"""μ-GRPO's algorithm core: pure torch, no Megatron, no I/O. Equation numbers refer to arXiv 2605.17570."""

from megamu.algo.advantages import ADVANTAGE_EPS, group_advantages
from megamu.algo.config import AGGREGATIONS, AlgoConfig
from megamu.algo.loss import aggregate, m2po_mask, policy_loss
from megamu.algo.presets import ALGORITHM_PRESETS, algo_preset
from megamu.algo.veto import VETO_SCOPES, veto_mask

__all__ = [
    "ADVANTAGE_EPS",
    "AGGREGATIONS",
    "ALGORITHM_PRESETS",
    "VETO_SCOPES",
    "AlgoConfig",
    "aggregate",
    "algo_preset",
    "group_advantages",
    "m2po_mask",
    "policy_loss",
    "veto_mask",
]
