"""Algorithm presets: μ-GRPO and the baselines the paper compares against (§5, App. B), in one place."""

from __future__ import annotations

from megamu.algo.config import AlgoConfig
from megamu.errors import ConfigError

ALGORITHM_PRESETS: dict[str, AlgoConfig] = {
    # μ-GRPO: relaxed clip [0, 5] + sequence-scope negative-advantage veto at τ = 1e-4 (§4, App. B).
    "mu-grpo": AlgoConfig("mu-grpo", clip_low=1.0, clip_high=4.0, veto_threshold=1e-4, veto_scope="sequence"),
    # Standard GRPO, ε = 0.2; run with μ = 4 (low staleness).
    "grpo": AlgoConfig("grpo", clip_low=0.2, clip_high=0.2),
    # Same rule at μ = 1024 through the staged pipeline: isolates the effect of the stabiliser (App. B).
    "grpo-high-staleness": AlgoConfig("grpo-high-staleness", clip_low=0.2, clip_high=0.2),
    # Relaxed clipping without the veto: the ablation that collapses (§3.1, Fig. 2).
    "grpo-relaxed": AlgoConfig("grpo-relaxed", clip_low=1.0, clip_high=4.0),
    # M2PO: no ratio clip, second-moment mask at 0.04 (App. B).
    "m2po": AlgoConfig("m2po", clip_low=1.0, clip_high=None, m2po_threshold=0.04),
    # DAPO (arXiv 2503.14476 §3, Table 1's run; verl recipe/dapo/run_dapo_qwen2.5_32b.sh): clip-higher ε_low 0.2,
    # ε_high 0.28; token-level loss; soft overlong punishment with a 4096-token buffer (of a 20480-token limit),
    # factor 1; dynamic sampling, at most 10 generation rounds per batch; no KL term, no entropy term.
    "dapo": AlgoConfig("dapo", clip_low=0.2, clip_high=0.28, aggregation="token-mean", overlong_buffer=4096,
                       overlong_penalty_factor=1.0, dynamic_sampling=True, max_sampling_rounds=10),
}


def algo_preset(name: str) -> AlgoConfig:
    if name not in ALGORITHM_PRESETS:
        raise ConfigError("name", f"must be one of {sorted(ALGORITHM_PRESETS)}, got {name!r}")
    return ALGORITHM_PRESETS[name]
