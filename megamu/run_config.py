"""The run's records, made from the flags by megamu.arguments: its shape (``Plan``, printed by --dry-run) and
everything a run is built from (``RunConfig``: one config per part plus the loop's own settings)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path

from megamu.algo import AlgoConfig
from megamu.data.stage_prompts import PromptsConfig
from megamu.device import Device
from megamu.engines import EngineConfig
from megamu.errors import ConfigError, build_at, check_choice, check_non_negative, check_positive
from megamu.loop_config import AsyncConfig, EvalConfig
from megamu.memory_plan import MemoryPlanConfig, ModelShape
from megamu.policy import PolicyConfig
from megamu.rollout import RolloutConfig
from megamu.run_dir import RunDir
from megamu.tracking import TrackerConfig

ROLLOUT_MODES = ("staged", "colocated", "async")


def stage_counts(prompts_per_stage: int | None, prompts_per_update: int | None, mu: int | None,
                 num_stages: int | None, train_iters: int | None) -> tuple[int, int, int]:
    """(num_stages, B_mini, μ) from any two of B_train, B_mini, μ (B_train = μ · B_mini) and at most one of
    num_stages, train_iters (= num_stages · μ). None of them given: the CPU demo's 64 prompts per stage, 4 per update,
    2 stages."""
    b_train, b_mini = prompts_per_stage, prompts_per_update
    for name, v in (("prompts_per_stage", b_train), ("prompts_per_update", b_mini), ("mu", mu),
                    ("num_stages", num_stages), ("train_iters", train_iters)):
        if v is not None and v <= 0:
            raise ConfigError(name, f"must be a positive integer, got {v}")
    given = sum(v is not None for v in (b_train, b_mini, mu))
    if given == 0:
        b_train, b_mini = 64, 4
    elif given == 1 and b_mini is None:
        b_mini = 4 if b_train is None else min(4, b_train)
    elif given == 1:
        mu = 16
    if b_train is None:
        b_train = mu * b_mini
    elif b_mini is None:
        if b_train % mu:
            raise ConfigError("mu", f"prompts per stage {b_train} is not divisible by μ = {mu}")
        b_mini = b_train // mu
    if b_train % b_mini:
        raise ConfigError("prompts_per_update", f"prompts per stage {b_train} is not a multiple of {b_mini}")
    if mu is not None and mu * b_mini != b_train:
        raise ConfigError("mu", f"μ = {mu} contradicts {b_train} prompts per stage / {b_mini} per update")
    mu = b_train // b_mini
    if train_iters is not None:
        if train_iters % mu:
            raise ConfigError("train_iters", f"{train_iters} is not a multiple of μ = {mu}")
        if num_stages not in (None, train_iters // mu):
            raise ConfigError("train_iters", f"{train_iters} contradicts {num_stages} stages x μ = {mu}")
        num_stages = train_iters // mu
    return (2 if num_stages is None else num_stages), b_mini, mu


@dataclass
class Plan:
    """The run's shape (printed by --dry-run). Staged modes: ``num_stages`` stages of μ updates on B_train = μ · B_mini
    prompts each. Async mode: ``train_iters`` updates on a stream, a weight push every N, samples older than K
    dropped; it has no stages."""

    prompts_per_update: int  # B_mini
    n_samples_per_prompt: int  # G
    max_response_len: int
    algorithm: str
    rollout_mode: str
    num_stages: int | None = None  # staged modes
    mu: int | None = None  # staged modes
    train_iters: int | None = None  # async mode
    weight_sync_interval: int | None = None  # async mode: N (staged modes push once per stage)
    max_policy_lag: int | None = None  # async mode: K

    def __post_init__(self):
        check_choice(self, "rollout_mode", ROLLOUT_MODES)
        check_positive(self, "prompts_per_update", "n_samples_per_prompt", "max_response_len", "num_stages", "mu",
                       "train_iters", "weight_sync_interval", "max_policy_lag")
        staged, stream = ("num_stages", "mu"), ("train_iters", "weight_sync_interval", "max_policy_lag")
        need, refuse = (stream, staged) if self.is_async else (staged, stream)
        for name in need:
            if getattr(self, name) is None:
                raise ConfigError(name, f"required in {self.rollout_mode} mode")
        for name in refuse:
            if getattr(self, name) is not None:
                raise ConfigError(name, f"has no meaning in {self.rollout_mode} mode")
        if self.is_async and self.max_policy_lag < self.weight_sync_interval:
            raise ConfigError("max_policy_lag", f"{self.max_policy_lag} is below the weight sync interval "
                              f"{self.weight_sync_interval}: between syncs the engine's weights fall that far behind, "
                              "so every sample would be dropped")

    @property
    def is_async(self) -> bool:
        return self.rollout_mode == "async"

    @property
    def total_updates(self) -> int:
        return self.train_iters if self.is_async else self.num_stages * self.mu

    @property
    def prompts_per_stage(self) -> int | None:
        """B_train (staged modes)."""
        return None if self.is_async else self.mu * self.prompts_per_update

    @property
    def weight_syncs(self) -> int:
        """One per stage; async: one every N updates, none after the last."""
        return (self.train_iters - 1) // self.weight_sync_interval if self.is_async else self.num_stages

    def summary(self) -> dict:
        """Every count the plan implies. Async samples are those trained on (the engine also generates the groups it
        drops and those left in the queue at the end)."""
        common = {"prompts_per_update": self.prompts_per_update, "n_samples_per_prompt": self.n_samples_per_prompt,
                  "max_response_len": self.max_response_len, "algorithm": self.algorithm,
                  "rollout_mode": self.rollout_mode, "total_updates": self.total_updates,
                  "total_samples": self.total_updates * self.prompts_per_update * self.n_samples_per_prompt,
                  "weight_syncs": self.weight_syncs}
        if self.is_async:
            return {**common, "train_iters": self.train_iters, "weight_sync_interval": self.weight_sync_interval,
                    "max_policy_lag": self.max_policy_lag}
        samples = self.prompts_per_stage * self.n_samples_per_prompt
        return {**common, "num_stages": self.num_stages, "mu": self.mu, "updates_per_stage": self.mu,
                "prompts_per_stage": self.prompts_per_stage, "samples_per_stage": samples,
                "max_tokens_per_stage": samples * self.max_response_len}

    def describe(self, algo: AlgoConfig, precision: str, device: str = "") -> str:
        d = self.summary()
        if self.is_async:
            shape = [("total updates", d["total_updates"]), ("B_mini (prompts per update)", d["prompts_per_update"]),
                     ("G (samples per prompt)", d["n_samples_per_prompt"]), ("samples trained on", d["total_samples"]),
                     ("weight sync interval N", d["weight_sync_interval"]), ("weight syncs", d["weight_syncs"]),
                     ("max policy lag K", d["max_policy_lag"])]
        else:
            shape = [("stages", d["num_stages"]), ("μ (updates per stage)", d["mu"]),
                     ("B_train (prompts per stage)", d["prompts_per_stage"]),
                     ("B_mini (prompts per update)", d["prompts_per_update"]),
                     ("G (samples per prompt)", d["n_samples_per_prompt"]), ("total updates", d["total_updates"]),
                     ("samples per stage", d["samples_per_stage"]), ("total samples", d["total_samples"]),
                     ("max response tokens per stage", d["max_tokens_per_stage"]),
                     ("weight syncs", d["weight_syncs"])]
        rows = shape + [("rollout mode", d["rollout_mode"]), ("training precision", precision),
                        ("algorithm", f"{d['algorithm']} {algo.describe()}")] + ([("device", device)] if device else [])
        width = max(len(k) for k, _ in rows)
        return "\n".join(f"  {k:<{width}}  {v}" for k, v in rows)

    def json_line(self) -> str:
        return "plan: " + json.dumps(self.summary())


@dataclass(frozen=True)
class RunConfig:
    """Everything a run is built from: one config per part, plus the loop's own settings (megamu.loop.run.Run).

    A field left None where a comment says "derived" follows from the mode and the device; ``__post_init__`` fills it
    in (``derive``), here and nowhere else, so a config built in code runs as the same one built from flags."""

    plan: Plan
    algo: AlgoConfig
    device: Device
    policy: PolicyConfig
    engine: EngineConfig
    rollout: RolloutConfig
    prompts: PromptsConfig
    save: Path
    seed: int
    tensorboard_dir: str | None = None  # derived: <save>/tensorboard
    tensor_model_parallel_size: int = 1
    expert_model_parallel_size: int = 1  # MoE: experts split over this many ranks (GPU only)
    distributed_timeout_minutes: float | None = None
    cpu_threads: int | None = None  # derived, CPU async mode: the trainer's torch threads (the engine has the rest)
    log_interval: int = 1
    save_interval: int = 0
    hf_export_interval: int = 0
    keep_hf_exports: int | None = None  # hf/iter_N exports kept, newest first (0: all); derived: keep_checkpoints
    recompute_behaviour_logprobs: bool = False
    async_: AsyncConfig | None = None  # --rollout-mode async only
    dry_run: bool = False
    memory: MemoryPlanConfig | None = None  # GPU runs whose model config is readable: what each GPU holds per phase
    evaluation: EvalConfig = EvalConfig()
    tracker: TrackerConfig = TrackerConfig()

    def __post_init__(self):
        if (self.async_ is not None) != self.plan.is_async:
            raise ConfigError("async_", "the engine process's settings go with --rollout-mode async, and only there")
        self.derive()
        check_positive(self, "tensor_model_parallel_size", "expert_model_parallel_size", "log_interval", "cpu_threads")
        if self.expert_model_parallel_size > 1 and not self.device.is_cuda and not self.dry_run:
            # megatron-core 0.16.1's allgather dispatcher gathers the tokens over TP x EP into a CUDA tensor
            # (tensor_parallel/mappings.py:141); its alltoall dispatcher creates a CUDA stream (token_dispatcher.py:445)
            raise ConfigError("expert_model_parallel_size", f"{self.expert_model_parallel_size}: megatron-core runs "
                              "expert parallelism on CUDA only")
        check_non_negative(self, "save_interval", "hf_export_interval", "keep_hf_exports")
        if self.distributed_timeout_minutes is not None and not self.distributed_timeout_minutes > 0:
            raise ConfigError("distributed_timeout_minutes", f"must be > 0, got {self.distributed_timeout_minutes}")
        if self.engine.kind == "sglang" and self.engine.sglang.weight_sync == "memory" \
                and self.plan.rollout_mode != "colocated":
            raise ConfigError("engine.sglang.weight_sync", "memory needs --rollout-mode colocated (staged mode starts "
                                                           "each stage's servers from the stage's export)")
        if self.async_ is not None and self.async_.queue_groups < self.plan.prompts_per_update:
            raise ConfigError("async_.queue_groups", f"must hold one update's {self.plan.prompts_per_update} groups")
        if self.async_ is not None and self.async_.rollout_devices and not self.device.is_cuda and not self.dry_run:
            raise ConfigError("async_.rollout_devices", "needs GPUs; on CPU the engine process shares the cores with "
                                                        "the trainer")
        interval = self.evaluation.eval_interval
        if interval and self.plan.is_async:
            raise ConfigError("evaluation.eval_interval", "async mode evaluates after its last update only (its "
                                                          "engine process has no held-out prompts)")
        if interval and interval % self.plan.mu:
            raise ConfigError("evaluation.eval_interval", f"{interval} is not a multiple of μ = {self.plan.mu}: "
                                                          "evaluations run on the engine, which holds the policy of "
                                                          "a stage's start")
        if self.recompute_behaviour_logprobs and self.plan.rollout_mode == "async":
            raise ConfigError("recompute_behaviour_logprobs", "recompute needs a static dataset; async mode uses the "
                                                              "engine's log-probs")

    def derive(self) -> None:
        """Fill in the fields left None that follow from the mode and the device (explicit values stay). Frozen
        children are replaced, and this config's own fields set with object.__setattr__."""
        plan, device, set_ = self.plan, self.device, partial(object.__setattr__, self)
        if self.tensorboard_dir is None:
            set_("tensorboard_dir", str(RunDir(self.save).tensorboard))
        if self.policy.offload_train is None:
            # staged and colocated engines take turns with the trainer for the device; async ones have their own
            set_("policy", build_at("policy", replace, self.policy, offload_train=not plan.is_async))
        engine = self.engine
        sglang = engine.sglang
        if engine.kind == "sglang":  # colocated servers share the trainer's devices; staged and async ones do not
            sglang = build_at("engine.sglang", sglang.placed, plan.rollout_mode == "colocated", device.backend)
        dtype = engine.dtype or ("bfloat16" if self.policy.bf16 else "float32")  # the engine runs what is exported
        set_("engine", build_at("engine", replace, engine, dtype=dtype, sglang=sglang))
        if self.keep_hf_exports is None:
            set_("keep_hf_exports", self.policy.keep_checkpoints)
        if self.async_ is not None:
            a = self.async_
            # CPU: the engine process and the trainer split the cores (each thread count set, so neither spins)
            threads = a.worker_threads if a.worker_threads or device.is_cuda else max(1, (os.cpu_count() or 2) // 2)
            queue = a.queue_groups or AsyncConfig.default_queue_groups(plan, self.rollout.groups_per_shard)
            set_("async_", build_at("async_", replace, a, queue_groups=queue, worker_threads=threads))
            if self.cpu_threads is None and not device.is_cuda:
                set_("cpu_threads", max(1, (os.cpu_count() or 2) - threads))

    def describe(self) -> str:
        precision = "bf16" if self.policy.bf16 else "fp32"
        return self.plan.describe(self.algo, f"{precision}, HF exports {self.policy.export_dtype or precision}, "
                                             f"engine {self.engine.dtype}", self.device.describe())


def memory_plan_of(model_config: dict | None, run: RunConfig, *, world: int, gpu_memory_gib: float,
                   for_gpu: bool) -> MemoryPlanConfig | None:
    """The memory plan's inputs for a run meant for GPUs whose model config is readable here; None otherwise (and
    for models the plan does not model, e.g. DeepSeek-style shared experts, with a note)."""
    if model_config is None or not for_gpu:
        return None
    policy, engine, plan, prompts = run.policy, run.engine, run.plan, run.prompts
    tp, ep = run.tensor_model_parallel_size, run.expert_model_parallel_size
    try:
        model = ModelShape.from_hf_config(model_config)
    except ConfigError as e:
        print(f"note: no memory plan for this model: {e.message}", flush=True)
        return None
    sg = engine.sglang
    args = list(sg.extra_server_args)
    fraction = next((float(v) for k, v in zip(args, args[1:]) if k == "--mem-fraction-static"), None)
    servers = sg.num_servers * sg.tp_size if engine.kind == "sglang" else 1
    return MemoryPlanConfig(
        model=model, micro_batch_size=policy.micro_batch_size,
        max_seq_len=prompts.max_prompt_length + plan.max_response_len, max_response_len=plan.max_response_len,
        params_dtype="bf16" if policy.bf16 else "fp32", tp=tp, ep=ep, dp=max(1, world // tp),
        recompute_granularity=policy.recompute_granularity,
        transformer_impl=policy.transformer_impl or "transformer_engine", rollout_mode=plan.rollout_mode,
        offload_train=policy.offload_train, servers_per_gpu=max(1, servers // max(world, 1)),
        server_tp=sg.tp_size if engine.kind == "sglang" else 1,
        mem_fraction_static=MemoryPlanConfig.mem_fraction_static if fraction is None else fraction,
        release_during_training=engine.kind == "sglang" and sg.memory_saver, gpu_memory_gib=gpu_memory_gib,
        temperature=policy.temperature,
        weight_push=(sg.weight_sync if engine.kind == "sglang" else "memory") if plan.rollout_mode == "colocated"
        else None, push_bucket_mb=sg.weight_bucket_mb, push_bucket_copies=sg.num_servers * sg.tp_size)
