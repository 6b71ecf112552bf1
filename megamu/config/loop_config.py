"""Settings of the loop's parts, apart from the loop that runs them, so the run's config
(megamu.config.run_config) needs nothing of megamu.loop: the async engine process (``AsyncConfig``,
megamu.loop.async_) and evaluation during training (``EvalConfig``, megamu.evaluation.heldout)."""

from __future__ import annotations

from dataclasses import dataclass

from megamu.config_fields import flag
from megamu.errors import ConfigError, check_non_negative, check_positive


@dataclass(frozen=True)
class AsyncConfig:
    """The engine process's own settings (the lag bound K and the sync interval N are the run's plan). None: the
    run's RunConfig derives it from the plan and the device (``queue_groups``: ``default_queue_groups``;
    ``worker_threads``: half the cores on CPU, where the two processes share them)."""

    # the engine stays at most this many stored-but-unconsumed groups ahead
    queue_groups: int | None = flag("--rollout-queue-groups", default=None, type=int, help=(
        "groups the engine may store ahead of the trainer (default: what keeps the lag within K, about (K - N) x "
        "--prompts-per-update)"))
    worker_threads: int | None = None  # CPU: torch threads of the engine process (GPU: the device's default)
    rollout_devices: str | None = flag("--rollout-devices", default=None, help=(
        "GPU ids (CUDA_VISIBLE_DEVICES) of the engine process's SGLang servers; the trainer's GPUs are torchrun's own "
        "(launch it with CUDA_VISIBLE_DEVICES set to the others)"))

    def __post_init__(self):
        check_positive(self, "queue_groups", "worker_threads")

    @staticmethod
    def default_queue_groups(plan, groups_per_shard: int) -> int:
        """What keeps the lag within K by back-pressure: a group stored when the trainer is at version t is trained
        by update ≤ t + 1 + (queue + shard) / B_mini, and the engine's weights are at most N - 1 updates old (drops
        remain the guarantee, for what timing slips through)."""
        b_mini = plan.prompts_per_update
        return max(b_mini, (plan.max_policy_lag - plan.weight_sync_interval) * b_mini - groups_per_shard)


@dataclass(frozen=True)
class EvalConfig:
    """When and how the policy is evaluated during a run (megamu.evaluation.heldout)."""

    eval_interval: int = flag("--eval-interval", default=0, type=int, help=(
        "updates between evaluations, a multiple of μ: they run on the engine at a stage's start, where it holds the "
        "policy (0: before the first update and after the last only)"))
    n_samples_per_eval_prompt: int = flag("--n-samples-per-eval-prompt", default=0, type=int, help=(
        "k sampled replies per problem: sampled pass@1 (mean over k, the paper's avg@k) and pass@k beside greedy "
        "accuracy (0: greedy only)"))
    eval_max_response_len: int | None = flag("--eval-max-response-len", default=None, type=int, help=(
        "tokens an evaluation reply may take (slime's name; default: --rollout-max-response-len)"))
    eval_temperature: float = flag("--eval-temperature", default=1.0, type=float)
    eval_top_p: float = flag("--eval-top-p", default=1.0, type=float)

    def __post_init__(self):
        check_non_negative(self, "eval_interval", "n_samples_per_eval_prompt")
        if self.eval_max_response_len is not None and self.eval_max_response_len < 1:
            raise ConfigError("eval_max_response_len", f"must be >= 1, got {self.eval_max_response_len}")
        if self.eval_temperature <= 0:
            raise ConfigError("eval_temperature", f"must be > 0 for sampled evaluation, got {self.eval_temperature}")
        if not 0 < self.eval_top_p <= 1:
            raise ConfigError("eval_top_p", f"must be in (0, 1], got {self.eval_top_p}")

    def due(self, update: int) -> bool:
        """Whether the policy after ``update`` updates is evaluated mid-run (the first and last always are)."""
        return bool(self.eval_interval) and update > 0 and update % self.eval_interval == 0
