"""The engine process's settings in ``--rollout-mode async`` (``AsyncConfig``), apart from the loop that runs it
(megamu.loop.async_), so the run's config (megamu.run_config) needs nothing of the loop."""

from __future__ import annotations

from dataclasses import dataclass

from megamu.errors import check_positive


@dataclass(frozen=True)
class AsyncConfig:
    """The engine process's own settings (the lag bound K and the sync interval N are the run's plan). None: the
    run's RunConfig derives it from the plan and the device (``queue_groups``: ``default_queue_groups``;
    ``worker_threads``: half the cores on CPU, where the two processes share them)."""

    queue_groups: int | None = None  # the engine stays at most this many stored-but-unconsumed groups ahead
    worker_threads: int | None = None  # CPU: torch threads of the engine process (GPU: the device's default)
    rollout_devices: str | None = None  # GPU: CUDA_VISIBLE_DEVICES of the engine process (its SGLang servers)

    def __post_init__(self):
        check_positive(self, "queue_groups", "worker_threads")

    @staticmethod
    def default_queue_groups(plan, groups_per_shard: int) -> int:
        """What keeps the lag within K by back-pressure: a group stored when the trainer is at version t is trained
        by update ≤ t + 1 + (queue + shard) / B_mini, and the engine's weights are at most N - 1 updates old (drops
        remain the guarantee, for what timing slips through)."""
        b_mini = plan.prompts_per_update
        return max(b_mini, (plan.max_policy_lag - plan.weight_sync_interval) * b_mini - groups_per_shard)
