"""Algorithm presets: μ-GRPO and the baselines the paper compares against (arXiv 2605.17570 §5, App. B.1), in one
place. Each preset states every setting of the update rule that ``AlgoConfig`` requires (nothing is left to a
default that would silently make a named method another one); ``AlgoConfig.preset`` builds them."""

from __future__ import annotations

from types import MappingProxyType
from typing import Any

# The clip range is [1 - clip_low, 1 + clip_high] (Eq. 2's clip(ρ, 1 - ε, 1 + ε)); every preset aggregates per token
# then per reply (Eq. 2's 1/G Σ_i 1/T_i Σ_t, J_μ-GRPO's 1/|B| Σ 1/T Σ_t) except DAPO.
_GRPO = {"clip_low": 0.2, "clip_high": 0.2, "veto_threshold": None, "veto_scope": "sequence",
         "aggregation": "seq-mean-token-mean", "m2po_threshold": None}
_SETTINGS: dict[str, dict[str, Any]] = {
    # μ-GRPO (§4, J_μ-GRPO): relaxed clip(ρ, 0, 5) and the negative-advantage veto with the sequence scope S_seq at
    # τ_c = 1e-4 (Eq. 3's trigger; App. B.1: "we use the sequence-level ... scope S_seq ... and set τ_c = 10^-4").
    "mu-grpo": {**_GRPO, "clip_low": 1.0, "clip_high": 4.0, "veto_threshold": 1e-4},
    # Standard GRPO (Eq. 2), ε = 0.2, no KL term (§5, App. B.1); run with μ = 4 (low staleness).
    "grpo": dict(_GRPO),
    # The same rule at μ = 1024 through the staged pipeline: isolates the stabiliser (App. B.1, "high-staleness
    # GRPO ... default clipping and no negative-advantage veto").
    "grpo-high-staleness": dict(_GRPO),
    # Relaxed clipping [0, 5] without the veto: the ablation that collapses (§3.1, Fig. 2).
    "grpo-relaxed": {**_GRPO, "clip_low": 1.0, "clip_high": 4.0},
    # M2PO: no ratio clip, second-moment mask at the recommended 0.04 (§5, App. B.1).
    "m2po": {**_GRPO, "clip_low": 1.0, "clip_high": None, "m2po_threshold": 0.04},
    # DAPO (arXiv 2503.14476 §3, Table 1's run; verl-recipe dapo/run_dapo_qwen2.5_32b.sh): clip-higher ε_low 0.2,
    # ε_high 0.28, dual-clip c = 10 (the recipe's clip_ratio_c); token-level loss; soft overlong punishment with a
    # 4096-token buffer (of a 20480-token limit), factor 1; dynamic sampling on correctness (filter_groups.metric
    # acc), at most 10 generation rounds per batch; no KL term, no entropy term.
    "dapo": {**_GRPO, "clip_high": 0.28, "clip_ratio_c": 10.0, "aggregation": "token-mean", "overlong_buffer": 4096,
             "overlong_penalty_factor": 1.0, "dynamic_sampling": True, "max_sampling_rounds": 10,
             "filter_metric": "acc"},
}
PRESETS: MappingProxyType[str, MappingProxyType[str, Any]] = MappingProxyType(
    {name: MappingProxyType(settings) for name, settings in _SETTINGS.items()})
