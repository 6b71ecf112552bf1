"""How far a stage's updates moved the policy from the one that generated its data, read off their records.

Each stage's record carries its drift (the per-update ``approx_kl``, the k3 estimate of KL(β ‖ π_θ) per token,
megamu/algo/loss.py: median and max over the stage, and the veto's share of tokens), and the stage line prints it.

``HINT_KL`` is a heuristic, not a rule, fitted after the fact on one small task: in round two of the lab
(docs/fidelity-4stage.md, issue 42; a ~0.8 M-weight model on 6-digit addition) the μ-GRPO runs whose per-stage
median settled at 0.002-0.022 after the first stage ended between 0.04 below and 0.18 above clipped high-staleness
GRPO (four arms, two seeds each but one; on paired t intervals one clearly above, the rest inconclusive), and the one
run that stayed at 0.04-0.07 in every stage ended 0.14 below it (one seed) with a veto rate that climbed stage after
stage. 0.03 sits in the gap between those runs. On the runs it was not fitted to (round three, issue 51: two
μ-GRPO runs at lr 1e-5, the report's "drift hint on held-out runs" table) it stayed silent (stage medians 0.021 and
0.007 after the first) while both ended 0.09-0.12 below GRPO μ = 4: a quiet hint does not mean μ-GRPO keeps up. The
paper does not discuss per-stage drift: it trains
at lr 1e-6 with mini-batches of 32 prompt groups x 8 samples (App. B), where the lab's runs used 2 x 8 at lr 1e-5 to
3e-5. In the lab a lower lr and larger mini-batches both lowered the median KL per stage, which is what the hint
suggests.
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
                f"{self.kl_median:.3f} > {HINT_KL}): in the lab's small model the μ-GRPO run that drifted this far "
                "ended below clipped GRPO, and runs near 0.01 did better (a heuristic: docs/fidelity-4stage.md). "
                "Larger mini-batches (--prompts-per-update; the paper uses 32 x 8) or a lower --lr keep it smaller.")
