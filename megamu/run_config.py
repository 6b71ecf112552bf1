"""The run's records, made from the flags by megamu.arguments: its shape (``Plan``, printed by --dry-run) and
everything a run is built from (``RunConfig``: one config per part plus the loop's own settings)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from megamu.algo import AlgoConfig
from megamu.data.stage_prompts import PromptsConfig
from megamu.device import Device
from megamu.engines import EngineConfig
from megamu.errors import ConfigError, check_choice, check_non_negative, check_positive
from megamu.loop.async_ import AsyncConfig
from megamu.policy import PolicyConfig
from megamu.rollout import RolloutConfig

ROLLOUT_MODES = ("staged", "colocated", "async")


@dataclass
class Plan:
    """The run's shape: how many stages, updates and samples (printed by --dry-run)."""

    num_stages: int
    mu: int
    prompts_per_stage: int
    prompts_per_update: int
    n_samples_per_prompt: int
    max_response_len: int
    algorithm: str
    rollout_mode: str
    weight_sync_interval: int = 0  # async mode: updates between weight pushes (staged modes: one per stage)
    max_policy_lag: int | None = None  # async mode: K

    def __post_init__(self):
        check_positive(self, "num_stages", "mu", "prompts_per_stage", "prompts_per_update", "n_samples_per_prompt",
                       "max_response_len", "max_policy_lag")
        check_choice(self, "rollout_mode", ROLLOUT_MODES)
        if self.prompts_per_stage != self.mu * self.prompts_per_update:
            raise ConfigError("mu", f"B_train = {self.prompts_per_stage} is not μ x B_mini = {self.mu} x "
                                    f"{self.prompts_per_update}")
        if self.rollout_mode == "async":
            check_positive(self, "weight_sync_interval")
            if self.max_policy_lag is None or self.max_policy_lag < self.weight_sync_interval:
                raise ConfigError("max_policy_lag", f"{self.max_policy_lag} is below the weight sync interval "
                                  f"{self.weight_sync_interval}: between syncs the engine's weights fall that far "
                                  "behind, so every sample would be dropped")

    @property
    def total_updates(self) -> int:
        return self.num_stages * self.mu

    @property
    def samples_per_stage(self) -> int:
        return self.prompts_per_stage * self.n_samples_per_prompt

    def summary(self) -> dict:
        """Every count the plan implies (weight syncs: one per stage, or every N updates in async mode).

        Async mode is one "stage" of μ = --train-iters updates: its samples are those trained on (the engine also
        generates the groups it drops and those left in the queue at the end)."""
        is_async = self.rollout_mode == "async"
        syncs = (self.total_updates - 1) // self.weight_sync_interval if is_async else self.num_stages  # async: none
        # after the last update; its N and K mean nothing to the staged modes
        fields = {k: v for k, v in asdict(self).items()
                  if is_async or k not in ("weight_sync_interval", "max_policy_lag")}
        return {**fields, "updates_per_stage": self.mu, "total_updates": self.total_updates,
                "samples_per_stage": self.samples_per_stage, "total_samples": self.num_stages * self.samples_per_stage,
                "max_tokens_per_stage": self.samples_per_stage * self.max_response_len,
                "weight_syncs": syncs}

    def describe(self, algo: AlgoConfig, precision: str, device: str = "") -> str:
        d = self.summary()
        rows = [
            ("stages", d["num_stages"]), ("μ (updates per stage)", d["mu"]),
            ("B_train (prompts per stage)", d["prompts_per_stage"]),
            ("B_mini (prompts per update)", d["prompts_per_update"]),
            ("G (samples per prompt)", d["n_samples_per_prompt"]), ("total updates", d["total_updates"]),
            ("samples per stage", d["samples_per_stage"]), ("total samples", d["total_samples"]),
            ("max response tokens per stage", d["max_tokens_per_stage"]), ("weight syncs", d["weight_syncs"]),
            ("rollout mode", d["rollout_mode"]), ("training precision", precision),
            ("algorithm", f"{d['algorithm']} {algo.describe()}"),
        ] + ([("device", device)] if device else [])
        if self.rollout_mode == "async":  # no stages: the run is --train-iters updates on a stream
            rows = [r for r in rows if "stage" not in r[0]] + [
                ("weight sync interval N", self.weight_sync_interval), ("max policy lag K", self.max_policy_lag)]
        width = max(len(k) for k, _ in rows)
        return "\n".join(f"  {k:<{width}}  {v}" for k, v in rows)

    def json_line(self) -> str:
        return "plan: " + json.dumps(self.summary())


@dataclass(frozen=True)
class RunConfig:
    """Everything a run is built from: one config per part, plus the loop's own settings (megamu.loop.run.Run)."""

    plan: Plan
    algo: AlgoConfig
    device: Device
    policy: PolicyConfig
    engine: EngineConfig
    rollout: RolloutConfig
    prompts: PromptsConfig
    save: Path
    tensorboard_dir: str
    seed: int
    tensor_model_parallel_size: int
    distributed_timeout_minutes: float | None = None
    cpu_threads: int | None = None  # CPU async mode: the trainer's torch threads (the engine process has the rest)
    log_interval: int = 1
    save_interval: int = 0
    hf_export_interval: int = 0
    recompute_behaviour_logprobs: bool = False
    async_: AsyncConfig | None = None  # --rollout-mode async only
    dry_run: bool = False

    def __post_init__(self):
        check_positive(self, "tensor_model_parallel_size", "log_interval", "cpu_threads")
        check_non_negative(self, "save_interval", "hf_export_interval")
        if self.distributed_timeout_minutes is not None and not self.distributed_timeout_minutes > 0:
            raise ConfigError("distributed_timeout_minutes", f"must be > 0, got {self.distributed_timeout_minutes}")
        if (self.async_ is not None) != (self.plan.rollout_mode == "async"):
            raise ConfigError("async_", "the engine process's settings go with --rollout-mode async, and only there")
        if self.recompute_behaviour_logprobs and self.plan.rollout_mode == "async":
            raise ConfigError("behaviour_logprobs", "recompute needs a static dataset; async mode uses the "
                                                    "engine's log-probs")

    def describe(self) -> str:
        precision = "bf16" if self.policy.bf16 else "fp32"
        return self.plan.describe(self.algo, f"{precision}, HF exports {self.policy.export_dtype or precision}, "
                                             f"engine {self.engine.dtype}", self.device.describe())
