"""How a stage's samples are drawn and stored (``RolloutConfig``); megamu.rollout re-exports it."""

from __future__ import annotations

from dataclasses import dataclass, field

from megamu.config_fields import derived, flag
from megamu.engines.types import SamplingParams
from megamu.errors import ConfigError, check_positive
from megamu.reward.config import RewardConfig


@dataclass(frozen=True)
class RolloutConfig:
    """How each stage's samples are drawn (G per prompt, seeded by stage), scored and written (shards of groups).

    ``n_samples``, ``seed`` and ``max_new_tokens`` are the run's (plan.n_samples_per_prompt, seed,
    plan.max_response_len): None here, RunConfig.derive passes them down and refuses a copy that differs. The
    sampling temperature is stored here only (the policy's log-probs take it from here)."""

    n_samples: int | None = derived("plan.n_samples_per_prompt")  # G
    seed: int | None = derived("seed")  # stage k samples with seed + k
    temperature: float = flag("--rollout-temperature", default=1.0, type=float)
    top_p: float = flag("--rollout-top-p", default=1.0, type=float)
    max_new_tokens: int | None = derived("plan.max_response_len")
    groups_per_shard: int = flag("--rollout-groups-per-shard", default=16, type=int,
                                 help="prompt groups per durable shard")
    # engines that take whole calls (the local engine): shards per call
    shards_per_call: int = flag("--rollout-shards-per-call", default=1, type=int, help=(
        "shards handed to the engine at once (SGLang servers want hundreds of requests in flight)"))
    reward: RewardConfig = field(default_factory=RewardConfig)  # math-verify unless --reward code or --reward-fn

    def __post_init__(self):
        check_positive(self, "n_samples", "max_new_tokens", "groups_per_shard", "shards_per_call")
        if self.n_samples is not None and self.n_samples < 2:
            raise ConfigError("n_samples", "GRPO needs at least 2 samples per prompt for group advantages")
        if not self.temperature > 0:
            raise ConfigError("temperature", f"must be > 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ConfigError("top_p", f"must be in (0, 1], got {self.top_p}")

    def sampling(self, stage: int, stop_token_ids: list[int]) -> SamplingParams:
        """Stage k's sampling: its seed is seed + k, so each stage draws anew and a resumed stage draws the same."""
        return SamplingParams(temperature=self.temperature, top_p=self.top_p, max_new_tokens=self.max_new_tokens,
                              seed=self.seed + stage, stop_token_ids=list(stop_token_ids))
