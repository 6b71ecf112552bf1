"""How far a stage's updates moved the policy from the one that generated its data, read off their records.

The lab (docs/fidelity-4stage.md, issue 42) found this the quantity that decides whether μ-GRPO does well: runs whose
per-stage median ``approx_kl`` (the k3 estimate of KL(β ‖ π_θ) per token, megamu/algo/loss.py) settled at 0.002-0.022
after the first stage beat clipped high-staleness GRPO; the one that stayed at 0.04-0.07 in every stage lost to it,
and its veto rate climbed stage after stage. The paper keeps drift small with 32 x 8 mini-batches (§4); 1024 small
updates per stage at the same lr do not. So each stage's record carries its drift, the stage line prints it, and a
stage past the first whose median is above ``HINT_KL`` (between the lab's good and bad runs: a tiny model's number,
a hint, not a rule) says what to change.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

HINT_KL = 0.03


@dataclass(frozen=True)
class StageDrift:
    updates: int  # the stage's updates this process ran (fewer than μ in a stage resumed from a checkpoint)
    kl_median: float
    kl_max: float
    veto_token_fraction: float  # mean over the updates: the share of tokens the veto masked

    @classmethod
    def of(cls, kls: list[float], vetoes: list[float]) -> StageDrift | None:
        """From each update's ``approx_kl`` and ``veto_token_fraction``; an update without tokens (NaN) is left out."""
        pairs = [(k, v) for k, v in zip(kls, vetoes, strict=True) if not math.isnan(k)]
        if not pairs:
            return None
        kl = [k for k, _ in pairs]
        return cls(len(pairs), statistics.median(kl), max(kl), statistics.fmean(v for _, v in pairs))

    def record(self) -> dict[str, float]:
        return {"drift_updates": self.updates, "approx_kl_median": self.kl_median, "approx_kl_max": self.kl_max,
                "veto_token_fraction_mean": self.veto_token_fraction}

    def line(self) -> str:
        return (f"drift: KL median {self.kl_median:.4f} (max {self.kl_max:.4f}), "
                f"veto {100 * self.veto_token_fraction:.2f}% of tokens")

    def hint(self, stage: int) -> str | None:
        """A warning for a stage after the first that drifted past ``HINT_KL``; None otherwise."""
        if stage == 0 or self.kl_median <= HINT_KL:
            return None
        return (f"[stage {stage}] the policy drifted far from the rollout's (median per-token KL "
                f"{self.kl_median:.3f} > {HINT_KL}): in the lab, μ-GRPO lost to clipped GRPO at such drift and won "
                "where it stayed near 0.01 (docs/fidelity-4stage.md). Larger mini-batches (--prompts-per-update, "
                "the paper's 32 x 8) or a lower --lr keep it smaller.")
