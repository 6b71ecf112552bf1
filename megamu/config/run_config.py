"""Everything a run is built from (``RunConfig``: its plan, one config per part, the loop's own settings), made
from the flags by megamu.arguments or in code alike. The plan's types live in megamu.config.plan."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, replace
from functools import cached_property, partial
from pathlib import Path

from megamu.algo import AlgoConfig
from megamu.config.loop_config import AsyncConfig, EvalConfig
from megamu.config.plan import Plan, StagedPlan
from megamu.config_fields import derived, flag
from megamu.data.stage_prompts import PromptsConfig
from megamu.engines import EngineConfig
from megamu.errors import ConfigError, build_at, check_positive
from megamu.memory import measured_peaks as peaks_file
from megamu.memory.device_memory import parse_gpu_memory
from megamu.memory.memory_plan import H200_GIB, MemoryPlanConfig, ModelShape
from megamu.observability.tracking import TrackerConfig
from megamu.reward.pool import default_num_workers
from megamu.rollout import RolloutConfig
from megamu.run.run_dir import RunDir
from megamu.runtime.device import Device
from megamu.runtime.host_memory import host_memory_bytes
from megamu.training.policy import PolicyConfig

DEFAULT_ALGORITHM = "mu-grpo"  # --algorithm's default and a RunConfig's


@dataclass(frozen=True)
class RunConfig:
    """Everything a run is built from: one config per part, plus the loop's own settings (megamu.loop.trainer.Trainer).

    Each quantity is stored once: the algorithm (``algo``), G and the response bound (``plan``), the seed (here), the
    sampling temperature (``rollout``), the device (here), the run directory (``policy.checkpoint.save``). The parts
    that read one keep a copy left None in code; ``derive`` passes the value down and refuses a copy given in code
    that differs, naming both paths. A field left None where a comment says "derived" follows from the run;
    ``__post_init__`` fills it in (``derive``), here and nowhere else, so a config built in code from the
    dataclasses' defaults runs as the one built from the same flags (the defaults are the CPU demo's)."""

    plan: Plan = field(default_factory=StagedPlan)
    algo: AlgoConfig = field(default_factory=lambda: AlgoConfig.preset(DEFAULT_ALGORITHM))
    device: Device = field(default_factory=Device.detect)
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    engine: EngineConfig = field(default_factory=lambda: EngineConfig(kind=None))  # kind None: the device's
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    prompts: PromptsConfig = field(default_factory=PromptsConfig)
    seed: int = flag("--seed", default=1234, type=int)  # stage k samples with seed + k; prompts shuffled by it
    tensorboard_dir: str | None = flag("--tensorboard-dir", default=None,  # derived: <save>/tensorboard
                                       help="default: <save>/tensorboard")
    tensor_model_parallel_size: int = flag("--tensor-model-parallel-size", default=1, type=int)
    # MoE: experts split over this many ranks (GPU only)
    expert_model_parallel_size: int = flag("--expert-model-parallel-size", default=1, type=int, help=(
        "mixture-of-experts models: experts split over this many ranks (their count and top-k come from the HF "
        "config); GPU only, megatron-core runs expert parallelism on CUDA only"))
    # megatron-core's MoE parallel folding (parallel_state.py:786-805): the experts' own TP size; the expert groups,
    # ETP x EP x expert-DP, are formed over the same world as the dense TP x DP ones, independently of them
    expert_tensor_parallel_size: int | None = flag("--expert-tensor-parallel-size", default=None, type=int, help=(
        "mixture-of-experts models: each expert split over this many ranks, independently of "
        "--tensor-model-parallel-size (default: the TP size, megatron-core's); ETP x EP must divide the world"))
    distributed_timeout_minutes: float | None = flag("--distributed-timeout-minutes", default=None, type=float, help=(
        "timeout of the training collectives (default: torch's, 10 minutes for NCCL); the waits during rank 0's "
        "rollout are on the CPU and not bound by it"))
    cpu_threads: int | None = None  # derived, CPU async mode: the trainer's torch threads (the engine has the rest)
    log_interval: int = flag("--log-interval", default=1, type=int)
    recompute_behaviour_logprobs: bool = derived("--behaviour-logprobs", default=False)  # its "recompute"
    async_: AsyncConfig | None = derived("--rollout-mode")  # --rollout-mode async only
    dry_run: bool = flag("--dry-run", default=False, action="store_true",
                         help="validate and print the plan; start nothing")
    # The memory plan's own inputs; the plan is computed from the run where it is read (``memory``), not stored.
    gpu_memory_gib: float = flag("--gpu-memory-gib", default=H200_GIB, type=parse_gpu_memory, help=(
        "memory of one GPU for the memory plan that --dry-run prints and every GPU run checks, in GiB as nvidia-smi "
        "shows it, or h200 (143771 MiB, the default) or h100 (81559 MiB)"))
    measured_peaks: str | None = flag("--measured-peaks", default=None, help=(
        "the activation and logits peaks tools/gpu_check.py measured (its --measured-peaks file): the memory plan's "
        "margin for them shrinks from 15 %% to what the measurement says"))
    host_memory_gib: float | None = flag("--host-memory-gib", default=None, type=float, help=(
        "RAM of one node for the host-memory plan (default on GPU runs: the job's cgroup memory limit when one is set, "
        "else the machine's RAM; a dry run without GPUs plans the host only when given)"))
    # the launch's trainer ranks (torchrun's WORLD_SIZE, else 1; a dry run: slime's flags)
    world_size: int | None = derived("--actor-num-nodes/--actor-num-gpus-per-node")
    # trainer ranks per node (torchrun's LOCAL_WORLD_SIZE, else the world)
    ranks_per_node: int | None = derived("--actor-num-gpus-per-node")
    evaluation: EvalConfig = EvalConfig()
    tracker: TrackerConfig = TrackerConfig()

    def __post_init__(self):
        if (self.async_ is not None) != self.plan.mode.streams:
            raise ConfigError("async_", "the engine process's settings go with --rollout-mode async, and only there")
        self.derive()
        if self.measured_peaks is not None:
            peaks_file.load(self.measured_peaks)  # a bad file is refused at once, naming the entry
        check_positive(self, "tensor_model_parallel_size", "expert_model_parallel_size", "expert_tensor_parallel_size",
                       "log_interval", "cpu_threads", "world_size", "ranks_per_node")
        if self.expert_model_parallel_size > 1 and not self.device.is_cuda and not self.dry_run:
            # megatron-core 0.16.1's allgather dispatcher gathers the tokens over TP x EP into a CUDA tensor
            # (tensor_parallel/mappings.py:141); its alltoall dispatcher creates a CUDA stream (token_dispatcher.py:445)
            raise ConfigError("expert_model_parallel_size", f"{self.expert_model_parallel_size}: megatron-core runs "
                              "expert parallelism on CUDA only")
        etp = self.expert_tensor_parallel_size
        if etp not in (None, self.tensor_model_parallel_size) and not self.device.is_cuda and not self.dry_run:
            # the dispatchers gather tokens over ETP x EP (transformer/moe/token_dispatcher.py:74) through the same
            # CUDA-allocating gather (tensor_parallel/mappings.py:141); TP > 1 with MoE needs SP, CUDA only too
            raise ConfigError("expert_tensor_parallel_size", f"{etp} (TP {self.tensor_model_parallel_size}): "
                              "megatron-core runs experts at their own TP on CUDA only")
        if self.policy.sequence_parallel:
            self._check_sequence_parallel()
        if self.distributed_timeout_minutes is not None and not self.distributed_timeout_minutes > 0:
            raise ConfigError("distributed_timeout_minutes", f"must be > 0, got {self.distributed_timeout_minutes}")
        if self.engine.kind == "sglang" and self.engine.sglang.weight_sync == "memory" \
                and not self.plan.mode.shares_trainer_devices:
            raise ConfigError("engine.sglang.weight_sync", "memory needs --rollout-mode colocated (staged mode starts "
                                                           "each stage's servers from the stage's export)")
        if self.async_ is not None and self.async_.queue_groups < self.plan.prompts_per_update:
            raise ConfigError("async_.queue_groups", f"must hold one update's {self.plan.prompts_per_update} groups")
        if self.async_ is not None and self.async_.rollout_devices and not self.device.is_cuda and not self.dry_run:
            raise ConfigError("async_.rollout_devices", "needs GPUs; on CPU the engine process shares the cores with "
                                                        "the trainer")
        interval = self.evaluation.eval_interval
        if interval and self.plan.mode.streams:
            raise ConfigError("evaluation.eval_interval", "async mode evaluates after its last update only (its "
                                                          "engine process has no held-out prompts)")
        if interval and interval % self.plan.mu:
            raise ConfigError("evaluation.eval_interval", f"{interval} is not a multiple of μ = {self.plan.mu}: "
                                                          "evaluations run on the engine, which holds the policy of "
                                                          "a stage's start")
        if self.recompute_behaviour_logprobs and not self.plan.mode.has_stages:
            raise ConfigError("recompute_behaviour_logprobs", "recompute needs a static dataset; async mode uses the "
                                                              "engine's log-probs")
        self._check_dapo()

    def _check_sequence_parallel(self) -> None:
        """megatron-core's SP: with TP > 1 (megatron raises at TP 1, model_parallel_config.py:411: refused here by
        name rather than turned off as Megatron-LM does, so that no flag is silently dropped); on CUDA only, as EP:
        its gather and reduce-scatter allocate on ``torch.cuda.current_device()`` (tensor_parallel/mappings.py:141,
        :181). The CPU tests run it in worker processes that answer that call (tests/cpu_cuda_shim.py)."""
        if self.tensor_model_parallel_size == 1:
            raise ConfigError("policy.sequence_parallel", "needs --tensor-model-parallel-size > 1: it splits each "
                                                          "row's tokens over the tensor-parallel ranks")
        if not self.device.is_cuda and not self.dry_run:
            raise ConfigError("policy.sequence_parallel", "megatron-core runs sequence parallelism on CUDA only (its "
                              "gather and reduce-scatter allocate on torch.cuda.current_device(), "
                              "tensor_parallel/mappings.py:141, :181); drop the flag on CPU")

    def _check_dapo(self) -> None:
        """DAPO's rollout-side settings against the rollout they shape (megamu.algo.dapo)."""
        buffer, limit = self.algo.overlong_buffer, self.plan.max_response_len
        if buffer and buffer >= limit:
            raise ConfigError("algo.overlong_buffer", f"{buffer} tokens leaves no unpunished length under the "
                              f"response limit of {limit} (--rollout-max-response-len); DAPO used 4096 of 20480")
        if self.algo.dynamic_sampling and self.plan.mode.streams:
            raise ConfigError("algo.dynamic_sampling", "refills a stage's dataset: staged and colocated modes only")
        if buffer and self.plan.mode.streams:
            raise ConfigError("algo.overlong_buffer", "shapes a stage's rewards: staged and colocated modes only")
        per_round = self.algo.sampling_round_prompts
        if per_round is not None and not self.algo.dynamic_sampling:
            raise ConfigError("algo.sampling_round_prompts", "sizes dynamic sampling's rounds: needs "
                              "--dynamic-sampling (without it a stage generates its B_train prompts)")
        if per_round is not None and per_round < self.plan.prompts_per_stage:
            raise ConfigError("algo.sampling_round_prompts", f"{per_round} is fewer than the stage's "
                              f"{self.plan.prompts_per_stage} prompts (B_train): a round holds at least a stage")

    def derive(self) -> None:
        """Fill in the fields left None that follow from the run (explicit values stay; a copy of a quantity stored
        elsewhere must agree with it). Frozen children are replaced, this config's own fields set with
        object.__setattr__."""
        set_, run_dir = partial(object.__setattr__, self), RunDir(self.save)
        set_("plan", _passed_down(self.plan, "plan", algorithm=(self.algo.name, "algo.name")))
        plan, device = self.plan, self.device
        g, length, seed = ((plan.n_samples_per_prompt, "plan.n_samples_per_prompt"),
                           (plan.max_response_len, "plan.max_response_len"), (self.seed, "seed"))
        set_("rollout", _passed_down(self.rollout, "rollout", n_samples=g, seed=seed, max_new_tokens=length))
        self._derive_prompts(run_dir, length, seed)
        policy = _passed_down(self.policy, "policy", device=(device, "device"),
                              temperature=(self.rollout.temperature, "rollout.temperature"),
                              offload_dir=(run_dir.offload, "policy.checkpoint.save (RunDir(save).offload)"))
        if policy.offload_train is None:
            # staged and colocated engines take turns with the trainer for the device; async ones have their own
            policy = build_at("policy", replace, policy, offload_train=plan.mode.trainer_offloads)
        if not policy.optimizer.lr_decay_iters:  # lr decays over the run's updates unless given
            policy = replace(policy, optimizer=build_at("policy.optimizer", replace, policy.optimizer,
                                                        lr_decay_iters=plan.total_updates))
        set_("policy", policy)
        if self.tensorboard_dir is None:
            set_("tensorboard_dir", str(run_dir.tensorboard))
        if self.world_size is None:
            set_("world_size", int(os.environ.get("WORLD_SIZE", "1")))
        if self.ranks_per_node is None:
            set_("ranks_per_node", int(os.environ.get("LOCAL_WORLD_SIZE", self.world_size)))
        engine = self.engine
        if engine.kind is None:
            engine = build_at("engine", replace, engine, kind=device.rollout_engine)
        sglang = engine.sglang
        if engine.kind == "sglang" and sglang.num_servers is None:
            # on GPUs the servers of a staged or colocated run take the trainer's: one per tp_size GPUs of the node
            # (none idle during rollout); async servers have GPUs of their own (--rollout-devices)
            fill = self.for_gpu and not plan.mode.streams
            sglang = build_at("engine.sglang", replace, sglang,
                              num_servers=max(1, self.ranks_per_node // sglang.tp_size) if fill else 1)
        if engine.kind == "sglang":  # colocated servers share the trainer's devices; staged and async ones do not
            # a CPU dry run planning for GPUs (--bf16, Transformer Engine) shows (and memory-plans) the servers as
            # the GPU run places them; anything that starts is placed for its own device
            backend = "nccl" if self.dry_run and self.for_gpu else device.backend
            shares = plan.mode.shares_trainer_devices
            sglang = build_at("engine.sglang", sglang.placed, shares, backend)
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

    def _derive_prompts(self, run_dir: RunDir, length: tuple[int, str], seed: tuple[int, str]) -> None:
        plan, p = self.plan, self.prompts
        derived: dict = {}
        if p.builtin_rows is None:  # enough rows that the held-out split (at most half the data) holds all of it
            derived["builtin_rows"] = 0 if p.files else \
                max(plan.total_updates * plan.prompts_per_update, p.held_out) + p.held_out
        if p.answer_key is None:  # the key the reward reads: a code row's tests, or a math row's answer
            derived["answer_key"] = "tests" if self.rollout.reward.kind == "code" else "answer"
        if p.context_length is None:
            derived["context_length"] = model_context_length(self.policy.hf_checkpoint)
        p = build_at("prompts", replace, p, **derived) if derived else p
        set_ = partial(object.__setattr__, self)
        set_("prompts", _passed_down(p, "prompts", seed=seed, max_response_len=length,
                                     prompts_per_stage=(plan.prompts_per_stage, "plan (μ x prompts_per_update)"),
                                     data_dir=(run_dir.data, "policy.checkpoint.save (RunDir(save).data)")))

    @property
    def for_gpu(self) -> bool:
        """A run on GPUs, or a dry run planning for them (--bf16 and Transformer Engine run on GPUs only)."""
        return self.device.is_cuda or self.policy.bf16 or self.policy.transformer_impl == "transformer_engine"

    @cached_property
    def memory(self) -> MemoryPlanConfig | None:
        """What each GPU holds per phase, for runs meant for GPUs whose model config is readable here: computed
        from the run on first read (``memory_plan_of``), not a setting of its own."""
        return memory_plan_of(self)

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


def _passed_down(part, at: str, **copies: tuple[object, str]):
    """``part`` (the field ``at`` of a RunConfig) with each of its ``copies`` (field name: (the run's value, where the
    run stores it)) filled in where left None. A copy given that differs is refused naming both paths: the run
    stores the quantity once, and a part's copy is only ever the run's."""
    changes = {}
    for name, (value, source) in copies.items():
        current = getattr(part, name)
        if current is None:
            changes[name] = value
        elif current != value:
            raise ConfigError(f"{at}.{name}", f"{current!r} contradicts {source} = {value!r}: the run stores it once, "
                                              f"at {source} (leave {at}.{name} unset: it is passed down)")
    return build_at(at, replace, part, **changes) if changes else part


def hf_model_config(hf_checkpoint: str | None) -> dict | None:
    """--hf-checkpoint's config.json when its folder is readable here (a dry run of a cluster script may not see it;
    the demo model's is not read)."""
    path = Path(hf_checkpoint or "", "config.json")
    return json.loads(path.read_text()) if hf_checkpoint and path.exists() else None


def model_context_length(hf_checkpoint: str | None) -> int | None:
    """The model's context (config.json's max_position_embeddings), when its config is readable here."""
    return (hf_model_config(hf_checkpoint) or {}).get("max_position_embeddings")


def world_source(world: int) -> str:
    """Where a launch's world size came from, as megamu.arguments.defaults.world_size reads it."""
    if "WORLD_SIZE" in os.environ:
        return "from torchrun's WORLD_SIZE"
    if world > 1:
        return "from slime's --actor-num-nodes x --actor-num-gpus-per-node"
    return "no torchrun WORLD_SIZE and no --actor-num-nodes/--actor-num-gpus-per-node: give them to plan a cluster"


def memory_plan_of(run: RunConfig) -> MemoryPlanConfig | None:
    """The memory plan's inputs for a run meant for GPUs whose model config is readable here; None otherwise (and
    for models the plan does not model, e.g. DeepSeek-style shared experts, with a note). The host plan: the node's
    --host-memory-gib, else the job's cgroup memory limit or this machine's RAM on GPUs (a node checking itself), else
    none (a dry run on a machine without GPUs is not the node: its RAM says nothing)."""
    model_config = hf_model_config(run.policy.hf_checkpoint)
    if model_config is None or not run.for_gpu:
        return None
    policy, engine, plan, prompts = run.policy, run.engine, run.plan, run.prompts
    tp, ep, world = run.tensor_model_parallel_size, run.expert_model_parallel_size, run.world_size
    etp = run.expert_tensor_parallel_size or tp
    try:
        model = ModelShape.from_hf_config(model_config)
    except ConfigError as e:
        print(f"note: no memory plan for this model: {e.message}", flush=True)
        return None
    sg, mode = engine.sglang, plan.mode
    args = list(sg.extra_server_args)
    fraction = next((float(v) for k, v in zip(args, args[1:]) if k == "--mem-fraction-static"), None)
    servers = sg.num_servers * sg.tp_size if engine.kind == "sglang" else 1
    return MemoryPlanConfig(
        model=model, micro_batch_size=policy.micro_batch_size,
        max_tokens_per_micro_batch=policy.max_tokens_per_micro_batch,
        max_seq_len=prompts.max_prompt_length + plan.max_response_len, max_response_len=plan.max_response_len,
        params_dtype="bf16" if policy.bf16 else "fp32", tp=tp, ep=ep, etp=etp, dp=max(1, world // tp),
        recompute_granularity=policy.recompute_granularity, sequence_parallel=policy.sequence_parallel,
        transformer_impl=policy.transformer_impl or "transformer_engine", rollout_mode=plan.rollout_mode,
        offload_train=policy.offload_train, servers_per_gpu=max(1, servers // max(world, 1)),
        server_tp=sg.tp_size if engine.kind == "sglang" else 1,
        mem_fraction_static=MemoryPlanConfig.mem_fraction_static if fraction is None else fraction,
        release_during_training=mode.releases_during_training(engine.kind, bool(sg.memory_saver)),
        gpu_memory_gib=run.gpu_memory_gib, temperature=policy.logprob_temperature,
        reference_model=run.algo.uses_reference, weight_push=mode.weight_push(engine.kind, sg.weight_sync),
        push_bucket_mb=sg.weight_bucket_mb,
        push_bucket_copies=1 if world > 1 and not sg.urls else servers,  # rank_push.py
        host_memory_gib=run.host_memory_gib if run.host_memory_gib is not None
        else host_memory_bytes() / 2**30 if run.device.is_cuda else None,
        ranks_per_node=max(1, min(run.ranks_per_node, world)), save_optimizer=policy.checkpoint.save_optim,
        measured_peaks=None if run.measured_peaks is None else peaks_file.load(run.measured_peaks),
        world_source=world_source(world),
        reward_workers=run.rollout.reward.num_workers or default_num_workers())
