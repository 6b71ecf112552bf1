"""The update rule's settings (``AlgoConfig``): clipping range, veto, aggregation, M2PO mask."""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from megamu.algo.veto import VETO_SCOPES
from megamu.errors import ConfigError

AGGREGATIONS = ("seq-mean-token-mean", "token-mean", "seq-mean-token-sum")


@dataclass(frozen=True)
class AlgoConfig:
    """Everything ``policy_loss`` needs to know about the update rule (Eq. 2 and J_μ-GRPO of §4).

    Ratio clip range [1 - clip_low, 1 + clip_high] (``clip_high=None``: no upper bound); the negative-advantage veto
    with threshold τ = ``veto_threshold`` (None: off) and ``veto_scope`` (§3.3, App. C.2); ``aggregation`` of the
    per-token loss; ``m2po_threshold``: M2PO's second-moment mask (None: off)."""

    name: str
    clip_low: float = 0.2
    clip_high: float | None = 0.2
    veto_threshold: float | None = None
    veto_scope: str = "sequence"
    aggregation: str = "seq-mean-token-mean"
    m2po_threshold: float | None = None

    def __post_init__(self) -> None:
        if not 0.0 <= self.clip_low <= 1.0:
            raise ConfigError("clip_low", f"must be in [0, 1] (ratio lower bound 1 - clip_low), got {self.clip_low}")
        if self.clip_high is not None and self.clip_high < 0:
            raise ConfigError("clip_high", f"must be >= 0, got {self.clip_high}")
        if self.veto_threshold is not None and not 0.0 < self.veto_threshold < 1.0:
            raise ConfigError("veto_threshold", f"must be in (0, 1), got {self.veto_threshold}")
        if self.veto_scope not in VETO_SCOPES:
            raise ConfigError("veto_scope", f"must be one of {VETO_SCOPES}, got {self.veto_scope!r}")
        if self.aggregation not in AGGREGATIONS:
            raise ConfigError("aggregation", f"must be one of {AGGREGATIONS}, got {self.aggregation!r}")
        if self.m2po_threshold is not None and self.m2po_threshold <= 0:
            raise ConfigError("m2po_threshold", f"must be > 0, got {self.m2po_threshold}")

    def describe(self) -> dict:
        """The settings without the name (the dry-run plan prints them)."""
        d = asdict(self)
        d.pop("name")
        return d

    def with_overrides(self, **overrides) -> AlgoConfig:
        return replace(self, **{k: v for k, v in overrides.items() if v is not None})
