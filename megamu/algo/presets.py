"""Algorithm presets: μ-GRPO and the baselines the paper compares against (§5, App. B), in one place."""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from megamu.algo.loss import AGGREGATIONS
from megamu.algo.veto import VETO_SCOPES


@dataclass(frozen=True)
class AlgoConfig:
    """Everything ``policy_loss`` needs to know about the update rule."""

    name: str
    clip_low: float = 0.2
    clip_high: float | None = 0.2
    veto_threshold: float | None = None
    veto_scope: str = "sequence"
    aggregation: str = "seq-mean-token-mean"
    m2po_threshold: float | None = None

    def __post_init__(self) -> None:
        if not 0.0 <= self.clip_low <= 1.0:
            raise ValueError(f"--clip-low must be in [0, 1] (ratio lower bound 1 - clip_low), got {self.clip_low}")
        if self.clip_high is not None and self.clip_high < 0:
            raise ValueError(f"--clip-high must be >= 0, got {self.clip_high}")
        if self.veto_threshold is not None and not 0.0 < self.veto_threshold < 1.0:
            raise ValueError(f"--nav-threshold must be in (0, 1), got {self.veto_threshold}")
        if self.veto_scope not in VETO_SCOPES:
            raise ValueError(f"--nav-scope must be one of {VETO_SCOPES}, got {self.veto_scope!r}")
        if self.aggregation not in AGGREGATIONS:
            raise ValueError(f"--loss-aggregation must be one of {AGGREGATIONS}, got {self.aggregation!r}")
        if self.m2po_threshold is not None and self.m2po_threshold <= 0:
            raise ValueError(f"--m2po-threshold must be > 0, got {self.m2po_threshold}")

    def loss_kwargs(self) -> dict:
        d = asdict(self)
        d.pop("name")
        return d

    def with_overrides(self, **overrides) -> AlgoConfig:
        return replace(self, **{k: v for k, v in overrides.items() if v is not None})


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
}


def algo_preset(name: str) -> AlgoConfig:
    if name not in ALGORITHM_PRESETS:
        raise ValueError(f"--algorithm must be one of {sorted(ALGORITHM_PRESETS)}, got {name!r}")
    return ALGORITHM_PRESETS[name]
