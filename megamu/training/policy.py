"""The policy π_θ on the trainer's side: model, optimiser, checkpoints, HF exports and weights for an engine.

Everything here is collective: every rank calls every method (tensor-parallel gathers, barriers).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from megamu.algo import AlgoConfig
from megamu.config_fields import derived, flag
from megamu.convert import export_hf, full_state_dict, load_hf_into_model
from megamu.convert.checkpoint import DTYPES, training_dtype
from megamu.convert.mapping import mcore_to_hf_tensors
from megamu.engines.weights import LogprobProbe, Weights
from megamu.errors import ConfigError, check_choice, check_non_negative, check_positive
from megamu.memory.trainer_memory import TrainerMemory
from megamu.model import ModelArch, build_model
from megamu.model.config import MOE_LOAD_BALANCING, check_load_balancing
from megamu.model.moe_settings import MoeSettings
from megamu.rollout.records import RolloutSample
from megamu.runtime import parallel
from megamu.runtime.atomic import atomic_write
from megamu.runtime.device import Device
from megamu.training.checkpoint import load_checkpoint, load_model_checkpoint, save_checkpoint
from megamu.training.optimizer import OptimizerConfig, build_optimizer
from megamu.training.reference import ReferencePolicy
from megamu.training.step import compute_logprobs, train_step


@dataclass(frozen=True)
class CheckpointConfig:
    """Where the run's checkpoints and HF exports go, how often and how many stay; where a new run starts from."""

    save: Path = flag("--save", type=Path, default=Path("runs/cpu-demo"),
                      help="run directory: checkpoints, HF exports, rollouts, metrics")
    load: Path | None = flag("--load", default=None, type=Path, help=(
        "a new run's start point: an earlier run's checkpoint directory (its progress continues); a restart always "
        "resumes from --save's own latest checkpoint"))
    pretrained_checkpoint: Path | None = flag("--pretrained-checkpoint", "--ref-load", default=None, type=Path, help=(
        "a new run's initial weights from a torch_dist checkpoint (Megatron-LM's name; slime's --ref-load): weights "
        "only, update 0; --load and --save's checkpoints come first. Also the KL term's reference policy "
        "(--use-kl-loss; default: the initial HF weights)"))
    save_interval: int = flag("--save-interval", default=0, type=int,
                              help="updates between checkpoints (0: stage ends only)")
    keep: int = flag("--keep-checkpoints", default=2, type=int,
                     help="checkpoints kept under --save, newest first (0: all)")
    hf_export_interval: int = flag("--hf-export-interval", default=0, type=int, help=(
        "also export the policy as <save>/hf/iter_N every N updates, for evaluation (0: off)"))
    keep_hf_exports: int | None = flag("--keep-hf-exports", default=None, type=int, help=(
        "--hf-export-interval exports kept, newest first (0: all; default: --keep-checkpoints)"))
    save_optim: bool = flag("--save-optim", default=True, action="optional_bool", help=(
        "checkpoints carry the optimiser state (Megatron's --no-save-optim: weights only, a resume restarts Adam; "
        "the host-memory plan's fix when the save's host copy of the optimiser state does not fit)"))

    def __post_init__(self):
        check_non_negative(self, "save_interval", "keep", "hf_export_interval", "keep_hf_exports")

    @property
    def hf_exports_kept(self) -> int:
        return self.keep if self.keep_hf_exports is None else self.keep_hf_exports


@dataclass(frozen=True)
class PolicyConfig:
    """The trainer's side. ``device``, ``offload_dir`` and ``temperature`` are the run's (RunConfig.derive passes
    them down: its device, RunDir(save).offload, rollout.temperature); a policy on its own is given them."""

    hf_checkpoint: str | None = flag("--hf-checkpoint", default=None,
                                     help="initial policy: an HF folder, or a hub id found in the local HF cache "
                                          "(default: the demo model)")
    device: Device | None = None  # derived: the run's device
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    # where a CPU offload spills the trainer's state: megamu.run.run_dir.RunDir(save).offload
    offload_dir: Path | None = derived("policy.checkpoint.save")
    transformer_impl: str | None = flag("--transformer-impl", default=None, choices=["local", "transformer_engine"],
                                        help="layer implementation (default: transformer_engine on GPU, local on CPU)")
    bf16: bool = flag("--bf16", default=False, action="store_true")
    micro_batch_size: int = flag("--micro-batch-size", default=8, type=int, help="samples per micro-batch")
    max_tokens_per_micro_batch: int | None = flag("--max-tokens-per-micro-batch", default=None, type=int,
                                                  help="token budget of a micro-batch")
    # log-probs of softmax(logits / T), like the engine's behaviour log-probs; the run's rollout.temperature (None on
    # its own: T = 1)
    temperature: float | None = derived("rollout.temperature")
    skip_zero_advantage: bool = flag("--skip-zero-advantage", default=True, action="optional_bool", help=(
        "skip the forward/backward of A = 0 samples (all-equal groups): same update, less compute"))
    # HF exports and in-memory pushes: "bf16" | "fp16" | "fp32"; None: the training's
    export_dtype: str | None = flag("--export-dtype", default=None, choices=["bf16", "fp16", "fp32"], help=(
        "dtype of the HF exports the engine loads (default: the training precision)"))
    # Gradients and optimiser state (GPU: also weights) leave the device during rollouts. None: a run's RunConfig
    # sets it by mode (on where the engine takes turns with the trainer for the device); a policy on its own: off.
    offload_train: bool | None = flag("--offload-train", default=None, action="optional_bool", help=(
        "move the trainer's gradients and optimiser state (GPU: also weights) off the device while the engine "
        "generates (default: on in staged and colocated modes, off in async mode)"))
    sequence_parallel: bool = flag("--sequence-parallel", default=False, action="store_true", help=(
        "megatron-core's sequence parallelism: norms and residuals split over the tensor-parallel ranks (less "
        "activation memory); needs --tensor-model-parallel-size > 1 and GPUs"))
    recompute_granularity: str | None = flag("--recompute-granularity", default=None, choices=["full", "selective"],
                                             help="activation recomputation in the backward (less memory, ~1/3 more "
                                                  "compute for full)")
    # MoE router load balancing, megatron-core's own (TransformerConfig moe_router_load_balancing_type and
    # moe_aux_loss_coeff, transformer/moe/router.py); off by default: μ-GRPO's loss is the policy objective alone
    moe_router_load_balancing_type: str = flag(
        "--moe-router-load-balancing-type", default="none", choices=list(MOE_LOAD_BALANCING),
        help="the MoE router's auxiliary load-balancing loss (megatron's; default none)")
    moe_aux_loss_coeff: float = flag("--moe-aux-loss-coeff", default=0.0, type=float,
                                     help="its coefficient (megatron's; > 0 with a load-balancing type)")
    moe: MoeSettings = field(default_factory=MoeSettings)  # megatron's other MoE settings (Megatron-LM's flags)

    def __post_init__(self):
        check_positive(self, "micro_batch_size", "max_tokens_per_micro_batch")
        check_load_balancing(self.moe_router_load_balancing_type, self.moe_aux_loss_coeff)
        if self.temperature is not None and not self.temperature > 0:
            raise ConfigError("temperature", f"must be > 0, got {self.temperature}")
        for name, choices in (("export_dtype", DTYPES), ("recompute_granularity", ("full", "selective")),
                              ("transformer_impl", ("local", "transformer_engine"))):
            if getattr(self, name) is not None:
                check_choice(self, name, tuple(choices))

    @property
    def logprob_temperature(self) -> float:
        """The T of the trainer's log-probs: the run's sampling temperature, 1 for a policy on its own."""
        return 1.0 if self.temperature is None else self.temperature


def resolve_hf_checkpoint(path: str | None) -> Path:
    if path is None:
        from megamu.model.demo_model import smollm2_hf_dir

        return smollm2_hf_dir()
    return Path(path)


class Policy:
    def __init__(self, cfg: PolicyConfig):
        self.cfg = cfg
        self.hf_source = resolve_hf_checkpoint(cfg.hf_checkpoint)
        self.arch = ModelArch.from_hf(self.hf_source)
        if self.arch.num_experts and parallel.tp_size() > 1 and not cfg.sequence_parallel:
            # megatron-core trains MoE layers at TP > 1 only with sequence parallelism (0.16.1
            # transformer/moe/moe_layer.py:379 raises in training); with it, a tiny Qwen3-MoE at TP 2 matches TP 1
            # (tests/model/test_sequence_parallel.py)
            raise ConfigError("tensor_model_parallel_size", f"{parallel.tp_size()}: a mixture-of-experts model "
                              "at tensor-parallel size > 1 needs --sequence-parallel (megatron-core needs sequence "
                              "parallelism for MoE with TP > 1)")
        impl = cfg.transformer_impl or cfg.device.transformer_impl
        self.model = build_model(self.arch, device=cfg.device, transformer_impl=impl, bf16=cfg.bf16,
                                 recompute_granularity=cfg.recompute_granularity,
                                 load_balancing=(cfg.moe_router_load_balancing_type, cfg.moe_aux_loss_coeff),
                                 sequence_parallel=cfg.sequence_parallel, moe=cfg.moe)
        # a group's prompt packed once before its responses needs a per-row attention mask, which only the local
        # spec's PortableAttention takes; TE's fused attention gets one row per sample
        self.share_prompts = impl == "local"
        self.optimizer = build_optimizer(self.model, cfg.optimizer, cfg.device)
        self.mem_train: TrainerMemory | None = None  # after the latest update (the optimisation's footprint)
        self.mem_rollout: TrainerMemory | None = None  # while the latest rollout ran
        self._offloaded = False
        self.loaded_from: Path | None = None  # where load_latest took the weights from
        self.resumed = False  # load_latest resumed this run's own checkpoint (under save_dir)
        self._cuda_train = self._cuda_rollout = None  # torch.cuda.memory_allocated at the same two points (GPU)
        self.reference: ReferencePolicy | None = None  # the KL term's π_ref (build_reference), None without one

    def build_reference(self) -> ReferencePolicy:
        """π_ref for the KL term: a model built like this one holding the run's initial weights, whatever this run
        resumes from: --pretrained-checkpoint (slime's --ref-load, an alias), else the initial HF weights."""
        impl = self.cfg.transformer_impl or self.cfg.device.transformer_impl
        model = build_model(self.arch, device=self.cfg.device, transformer_impl=impl, bf16=self.cfg.bf16,
                            perform_initialization=False, sequence_parallel=self.cfg.sequence_parallel,
                            moe=self.cfg.moe)
        pretrained = self.cfg.checkpoint.pretrained_checkpoint
        if pretrained is not None:
            load_model_checkpoint(pretrained, model)
        else:
            load_hf_into_model(model, self.arch, self.hf_source)
        self.reference = ReferencePolicy(model, pin_memory=self.cfg.device.is_cuda)
        return self.reference

    def load_latest(self) -> dict | None:
        """The resume point before the start point: the run's own latest checkpoint under save_dir, so that a restart
        never goes back to where the run began (Megatron-LM and slime resume from --save the same way); else
        load_dir's (an earlier run: its progress continues here); else pretrained_checkpoint's weights alone; else
        the initial HF weights. Returns the checkpoint's ``extra``, or None for a new run (a checkpoint without
        megamu's run state, Megatron-LM's or a converted one, gives weights: a new run starts from them).
        ``loaded_from`` and ``resumed`` say which it was.

        After building the optimiser: the bf16 optimiser's fp32 main weights are refreshed from the loaded model."""
        self.resumed = False
        for folder in (self.cfg.checkpoint.save, self.cfg.checkpoint.load):
            if folder is None or not Path(folder).exists():
                continue
            extra = load_checkpoint(folder, self.model, self.arch, self.optimizer)
            if extra is not None:
                self.loaded_from = Path(folder)
                self.resumed = folder == self.cfg.checkpoint.save and extra.get("run_state", True)
                return extra if extra.get("run_state", True) else None
        pretrained = self.cfg.checkpoint.pretrained_checkpoint
        if pretrained is not None:  # weights only: Megatron-LM's --finetune start
            load_model_checkpoint(pretrained, self.model)
            self.loaded_from = Path(pretrained)
            return None
        load_hf_into_model(self.model, self.arch, self.hf_source)
        self.loaded_from = self.hf_source
        return None

    @property
    def version(self) -> int:
        """Optimiser updates applied to these weights: the policy version samples generated from them carry."""
        return self.optimizer.iteration

    def update(self, samples: list[RolloutSample], algo: AlgoConfig) -> dict[str, float]:
        c = self.cfg
        if algo.uses_reference:
            if self.reference is None:
                raise RuntimeError(f"algorithm {algo.name!r} has a KL term: call Policy.build_reference() first")
            samples = self.reference.score(samples, temperature=c.logprob_temperature,
                                           micro_batch_size=c.micro_batch_size,
                                           max_tokens_per_micro_batch=c.max_tokens_per_micro_batch,
                                           share_prompts=self.share_prompts)
        stats = train_step(self.model, self.optimizer, samples, algo, micro_batch_size=c.micro_batch_size,
                           max_tokens_per_micro_batch=c.max_tokens_per_micro_batch, temperature=c.logprob_temperature,
                           skip_zero_advantage=c.skip_zero_advantage, share_prompts=self.share_prompts)
        self.mem_train = self.optimizer.memory()
        self._cuda_train = self._cuda_allocated()
        return {**stats, "skipped_steps": self.optimizer.skipped_steps,
                "step_skipped": float(self.optimizer.last_step_skipped)}

    def behaviour_anchors(self, samples: list[RolloutSample], cache: Path) -> dict[tuple[int, int], list[float]]:
        """--behaviour-logprobs recompute: b_t = this policy's log-probs of ``samples``, cached in ``cache``."""
        if cache.exists():
            return torch.load(cache)
        values = compute_logprobs(self.model, samples, temperature=self.cfg.logprob_temperature,
                                  micro_batch_size=self.cfg.micro_batch_size,
                                  max_tokens_per_micro_batch=self.cfg.max_tokens_per_micro_batch,
                                  share_prompts=self.share_prompts)
        anchors = {(s.prompt_id, s.sample_index): v for s, v in zip(samples, values)}
        if parallel.is_main_rank():
            atomic_write(cache, lambda tmp: torch.save(anchors, tmp))
        parallel.wait_for_main_rank()
        return anchors

    def save(self, iteration: int, extra: dict) -> None:
        save_checkpoint(self.cfg.checkpoint.save, iteration, self.model, self.arch, self.optimizer, extra=extra,
                        keep=self.cfg.checkpoint.keep, save_optim=self.cfg.checkpoint.save_optim)

    def export(self, out: Path) -> Path:
        """The weights as an HF folder ``out`` (atomic; a finished folder of the same name is reused)."""
        exists = (out / "config.json").exists()
        parallel.barrier()  # every rank has looked before rank 0 writes: all take the same branch (export_hf's
        # collectives and barrier), whichever rank the scheduler delays
        if not exists:
            export_hf(self.model, self.arch, out, hf_source_dir=self.hf_source, dtype=self.export_dtype)
        return out

    @property
    def export_dtype(self) -> str:
        """What exports and in-memory pushes carry: --export-dtype, else the training precision."""
        return self.cfg.export_dtype or training_dtype(self.model)

    def weights(self, *, hf_dir: Path | None = None, tensors: bool = False, every_node: bool = False,
                probe_ids: list[int] | None = None) -> Weights:
        """The weights an engine is given (collective): exported to ``hf_dir``, as HF-named tensors (on global rank 0,
        or with ``every_node`` on each node's local rank 0), or both; with a log-prob probe of ``probe_ids`` for the
        engine to match after the push."""
        return Weights(version=self.version, hf_dir=self.export(hf_dir) if hf_dir is not None else None,
                       tensors=self.engine_weights(every_node) if tensors else None,
                       probe=self.logprob_probe(probe_ids) if probe_ids else None)

    def engine_weights(self, every_node: bool = False) -> dict[str, torch.Tensor] | None:
        """Full HF-named tensors for an in-memory push, in the export dtype, on global rank 0 (which pushes); None
        elsewhere. Collective over rank 0's TP group (and, for an MoE model at EP > 1, the ranks holding the other
        experts): they take part in each gather and drop the tensor at once, and the other data-parallel replicas
        gather nothing (unless experts at their own TP fold over them: ``parallel.gathers_full_weights``), so no
        rank but 0 ever holds a full copy.

        ``every_node``: on every rank instead, each on its own GPU, for pushes in which each rank hands its copy to
        the server on its GPU (CUDA IPC handles, rank_push.py). Then every replica gathers, each within its own TP
        and EP groups (as slime's colocated update does), and every rank keeps the result: the gathers are
        all-gathers, so every rank of a group sees the full tensors."""
        if not (every_node or parallel.gathers_full_weights()):
            return None
        keep = every_node or parallel.is_main_rank()
        dtype = DTYPES[self.export_dtype]
        gathered = mcore_to_hf_tensors(self.arch, full_state_dict(self.model, self.arch))
        if not keep:
            for _ in gathered:
                pass
            return None
        # copies, never views: at TP=1 the gather returns the parameters themselves, and the trainer offloads them
        # before the push (loop/staged.py ``publish``), which would empty the tensors being pushed
        return {n: t.to(dtype, copy=True) for n, t in gathered}

    def logprob_probe(self, token_ids: list[int]) -> LogprobProbe:
        """The trainer's teacher-forced log-probs of ``token_ids`` at temperature 1 (collective), to check that an
        engine serves these weights after a sync. Tolerance on the mean |difference| by dtype: float32 agrees to
        ~1e-6 (1e-3 leaves room for other kernels); bfloat16 keeps 8 mantissa bits, ~1e-2 per log-prob."""
        sample = RolloutSample(prompt_id=0, sample_index=0, prompt_ids=token_ids[:1], response_ids=token_ids[1:],
                               behaviour_logprobs=[0.0] * (len(token_ids) - 1), reward=0.0, advantage=0.0,
                               finish_reason="length")
        values = compute_logprobs(self.model, [sample], temperature=1.0, micro_batch_size=1)[0]
        return LogprobProbe(list(token_ids), values, tolerance=1e-3 if self.export_dtype == "fp32" else 0.05)

    def offload(self) -> None:
        """Before an engine generates: give back what the trainer does not need (§4). With ``offload_train`` the
        gradients and optimiser state (GPU: also parameters and fp32 main parameters) leave the device, spilled
        under ``offload_dir`` on CPU; then the allocator's cache goes back to the driver."""
        if self.cfg.offload_train and not self._offloaded:
            self.optimizer.offload(self.cfg.offload_dir)
            if self.reference is not None:
                self.reference.offload()
            self._offloaded = True
        self.cfg.device.release_cache()
        self.mem_rollout = self.optimizer.memory()
        self._cuda_rollout = self._cuda_allocated()

    def onload(self) -> None:
        """After the rollout: everything ``offload`` moved comes back, bit for bit."""
        if self._offloaded:
            self.optimizer.reload()
            if self.reference is not None:
                self.reference.reload()
            self._offloaded = False

    def memory_record(self) -> dict[str, float]:
        """trainer_mem_{rollout,train}_gib: bytes the trainer's own tensors held on the device while the engine ran
        and after the latest update (what is measured, not the process RSS: on CPU the in-process engine shares it)."""
        out = {}
        for key, mem in (("trainer_mem_rollout_gib", self.mem_rollout), ("trainer_mem_train_gib", self.mem_train)):
            if mem is not None:
                out[key] = mem.gib()
        for key, nbytes in (("cuda_allocated_rollout_gib", self._cuda_rollout),
                            ("cuda_allocated_train_gib", self._cuda_train)):
            if nbytes is not None:
                out[key] = nbytes / 2**30
        return out

    def _cuda_allocated(self) -> int | None:
        return torch.cuda.memory_allocated() if self.cfg.device.is_cuda else None
