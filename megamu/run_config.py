"""Everything a run is built from (``RunConfig``: its plan, one config per part, the loop's own settings), made
from the flags by megamu.arguments or in code alike. The plan's types live in megamu.plan."""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path

import psutil

from megamu.algo import AlgoConfig
from megamu.config_fields import flag
from megamu.data.stage_prompts import PromptsConfig
from megamu.device import Device
from megamu.engines import EngineConfig
from megamu.errors import ConfigError, build_at, check_positive
from megamu.loop_config import AsyncConfig, EvalConfig
from megamu.memory_plan import MemoryPlanConfig, ModelShape
from megamu.mode import mode_of
from megamu.plan import (  # noqa: F401  (the names run_config had)
    ROLLOUT_MODES,
    AsyncPlan,
    Plan,
    StagedPlan,
    stage_counts,
)
from megamu.policy import PolicyConfig
from megamu.reward.pool import default_num_workers
from megamu.rollout import RolloutConfig
from megamu.run_dir import RunDir
from megamu.tracking import TrackerConfig


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
    seed: int
    tensorboard_dir: str | None = flag("--tensorboard-dir", default=None,  # derived: <save>/tensorboard
                                       help="default: <save>/tensorboard")
    tensor_model_parallel_size: int = flag("--tensor-model-parallel-size", default=1, type=int)
    # MoE: experts split over this many ranks (GPU only)
    expert_model_parallel_size: int = flag("--expert-model-parallel-size", default=1, type=int, help=(
        "mixture-of-experts models: experts split over this many ranks (their count and top-k come from the HF "
        "config); GPU only, megatron-core runs expert parallelism on CUDA only"))
    distributed_timeout_minutes: float | None = flag("--distributed-timeout-minutes", default=None, type=float, help=(
        "timeout of the training collectives (default: torch's, 10 minutes for NCCL); the waits during rank 0's "
        "rollout are on the CPU and not bound by it"))
    cpu_threads: int | None = None  # derived, CPU async mode: the trainer's torch threads (the engine has the rest)
    log_interval: int = flag("--log-interval", default=1, type=int)
    recompute_behaviour_logprobs: bool = False
    async_: AsyncConfig | None = None  # --rollout-mode async only
    dry_run: bool = flag("--dry-run", default=False, action="store_true",
                         help="validate and print the plan; start nothing")
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
        if self.distributed_timeout_minutes is not None and not self.distributed_timeout_minutes > 0:
            raise ConfigError("distributed_timeout_minutes", f"must be > 0, got {self.distributed_timeout_minutes}")
        if self.engine.kind == "sglang" and self.engine.sglang.weight_sync == "memory" \
                and not mode_of(self.plan.rollout_mode).shares_trainer_devices:
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
        if self.recompute_behaviour_logprobs and not mode_of(self.plan.rollout_mode).has_stages:
            raise ConfigError("recompute_behaviour_logprobs", "recompute needs a static dataset; async mode uses the "
                                                              "engine's log-probs")
        self._check_dapo()

    def _check_dapo(self) -> None:
        """DAPO's rollout-side settings against the rollout they shape (megamu.algo.dapo)."""
        buffer, limit = self.algo.overlong_buffer, self.plan.max_response_len
        if buffer is not None and buffer >= limit:
            raise ConfigError("algo.overlong_buffer", f"{buffer} tokens leaves no unpunished length under the "
                              f"response limit of {limit} (--rollout-max-response-len); DAPO used 4096 of 20480")
        if self.algo.dynamic_sampling and self.plan.is_async:
            raise ConfigError("algo.dynamic_sampling", "refills a stage's dataset: staged and colocated modes only")
        if buffer is not None and self.plan.is_async:
            raise ConfigError("algo.overlong_buffer", "shapes a stage's rewards: staged and colocated modes only")

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
        if engine.kind is None:
            engine = build_at("engine", replace, engine, kind=device.rollout_engine)
        sglang = engine.sglang
        if engine.kind == "sglang":  # colocated servers share the trainer's devices; staged and async ones do not
            sglang = build_at("engine.sglang", sglang.placed, mode_of(plan.rollout_mode).shares_trainer_devices,
                              device.backend)
        dtype = engine.dtype or ("bfloat16" if self.policy.bf16 else "float32")  # the engine runs what is exported
        set_("engine", build_at("engine", replace, engine, dtype=dtype, sglang=sglang))
        if self.async_ is not None:
            a = self.async_
            # CPU: the engine process and the trainer split the cores (each thread count set, so neither spins)
            threads = a.worker_threads if a.worker_threads or device.is_cuda else max(1, (os.cpu_count() or 2) // 2)
            queue = a.queue_groups or AsyncConfig.default_queue_groups(plan, self.rollout.groups_per_shard)
            set_("async_", build_at("async_", replace, a, queue_groups=queue, worker_threads=threads))
            if self.cpu_threads is None and not device.is_cuda:
                set_("cpu_threads", max(1, (os.cpu_count() or 2) - threads))

    # The checkpoint settings the loops read, one CheckpointConfig (policy.checkpoint) in the tree.
    @property
    def save(self) -> Path:
        return self.policy.checkpoint.save

    @property
    def save_interval(self) -> int:
        return self.policy.checkpoint.save_interval

    @property
    def hf_export_interval(self) -> int:
        return self.policy.checkpoint.hf_export_interval

    @property
    def keep_hf_exports(self) -> int:
        return self.policy.checkpoint.hf_exports_kept

    def describe(self) -> str:
        precision = "bf16" if self.policy.bf16 else "fp32"
        return self.plan.describe(self.algo, f"{precision}, HF exports {self.policy.export_dtype or precision}, "
                                             f"engine {self.engine.dtype}", self.device.describe())


def memory_plan_of(model_config: dict | None, run: RunConfig, *, world: int, gpu_memory_gib: float,
                   for_gpu: bool, memory_saver: bool | None = None, host_memory_gib: float | None = None,
                   ranks_per_node: int = 1, read_host_memory: bool = False) -> MemoryPlanConfig | None:
    """The memory plan's inputs for a run meant for GPUs whose model config is readable here; None otherwise (and
    for models the plan does not model, e.g. DeepSeek-style shared experts, with a note). ``memory_saver``: whether
    the GPU run's servers have SGLang's memory saver (a CPU dry run's engine was placed for CPU, which has none);
    None: the run's own setting. ``host_memory_gib`` None: this machine's RAM (psutil) with ``read_host_memory`` (a
    GPU node checking itself), else no host plan (a dry run on a machine without GPUs is not the node: its RAM says
    nothing)."""
    if model_config is None or not for_gpu:
        return None
    policy, engine, plan, prompts = run.policy, run.engine, run.plan, run.prompts
    tp, ep = run.tensor_model_parallel_size, run.expert_model_parallel_size
    try:
        model = ModelShape.from_hf_config(model_config)
    except ConfigError as e:
        print(f"note: no memory plan for this model: {e.message}", flush=True)
        return None
    sg, mode = engine.sglang, mode_of(plan.rollout_mode)
    args = list(sg.extra_server_args)
    fraction = next((float(v) for k, v in zip(args, args[1:]) if k == "--mem-fraction-static"), None)
    servers = sg.num_servers * sg.tp_size if engine.kind == "sglang" else 1
    return MemoryPlanConfig(
        model=model, micro_batch_size=policy.micro_batch_size,
        max_tokens_per_micro_batch=policy.max_tokens_per_micro_batch,
        max_seq_len=prompts.max_prompt_length + plan.max_response_len, max_response_len=plan.max_response_len,
        params_dtype="bf16" if policy.bf16 else "fp32", tp=tp, ep=ep, dp=max(1, world // tp),
        recompute_granularity=policy.recompute_granularity,
        transformer_impl=policy.transformer_impl or "transformer_engine", rollout_mode=plan.rollout_mode,
        offload_train=policy.offload_train, servers_per_gpu=max(1, servers // max(world, 1)),
        server_tp=sg.tp_size if engine.kind == "sglang" else 1,
        mem_fraction_static=MemoryPlanConfig.mem_fraction_static if fraction is None else fraction,
        release_during_training=mode.releases_during_training(engine.kind, bool(
            sg.memory_saver if memory_saver is None else memory_saver)), gpu_memory_gib=gpu_memory_gib,
        temperature=policy.temperature, reference_model=run.algo.uses_reference,
        weight_push=mode.weight_push(engine.kind, sg.weight_sync), push_bucket_mb=sg.weight_bucket_mb,
        push_bucket_copies=1 if world > 1 and not sg.urls else sg.num_servers * sg.tp_size,  # rank_push.py
        host_memory_gib=host_memory_gib if host_memory_gib is not None
        else psutil.virtual_memory().total / 2**30 if read_host_memory else None,
        ranks_per_node=max(1, min(ranks_per_node, world)), save_optimizer=policy.checkpoint.save_optim,
        reward_workers=run.rollout.reward.num_workers or default_num_workers())
