"""Records that cross module boundaries: one rollout sample, as written by the rollout phase and read by the trainer."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class RolloutSample:
    """One response of a prompt group, with everything the optimisation phase needs.

    ``behaviour_logprobs[t]`` is log β(a_t | x, a_<t) of the temperature-scaled distribution
    (log_softmax(logits / T)), the anchor b_t of the paper's ratio ρ_t = exp(log π_θ − b_t) (§4).
    """

    prompt_id: int  # the group's index within its stage; in async mode its queue position (unique over the run)
    sample_index: int  # 0..G-1 within the group
    prompt_ids: list[int]
    response_ids: list[int]
    behaviour_logprobs: list[float]
    reward: float
    advantage: float
    finish_reason: str  # "stop" | "length" | "abort"
    stage: int = 0
    policy_version: int = 0
    # log π_ref(a_t | x, a_<t) of a frozen reference policy (the KL term, megamu.algo.kl); set by the trainer just
    # before an update (Policy.update), never stored with the stage's rollouts
    ref_logprobs: list[float] | None = None

    @property
    def response_length(self) -> int:
        return len(self.response_ids)
