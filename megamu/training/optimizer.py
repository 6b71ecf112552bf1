"""The optimiser, one implementation per device (chosen by ``build_optimizer`` from the
``megamu.runtime.device.Device``).

CPU: ``torch.optim.AdamW``; gradients are SUMMED over the data-parallel group (the loss of each micro-batch is already
scaled by its share of the global minibatch, see ``megamu.training.step``), clipped by the norm of the full model, then
stepped. GPU: megatron-core DDP (``calculate_per_token_loss`` so it also sums) + DistributedOptimizer.

Both expose the same small surface: ``zero_grad()``, ``step() -> (grad_norm, lr)``, ``state_dict()`` /
``load_state_dict()`` for the scalar state (update count), and ``param_state(p)`` / ``load_param_state(p, state)`` for
the Adam moments (GPU bf16: and fp32 main weight) of one parameter as this rank's TP shard (complete over DP), which
``megamu.training.checkpoint`` turns into the TP-independent full layout.

A non-finite gradient norm skips the update (Megatron's behaviour; every rank sees the same reduced norm, so all
skip together): ``skipped_steps`` counts them, ``last_step_skipped`` tells the caller, and more than
``max_skipped_steps`` in a row raise. ``offload(spill_dir)`` / ``reload()`` take the trainer's memory away for a
rollout and give it back bitwise; ``memory()`` reports what the trainer's tensors occupy
(``megamu.memory.trainer_memory``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from megamu.config_fields import flag
from megamu.errors import ConfigError
from megamu.memory.trainer_memory import TrainerMemory, storage_bytes
from megamu.runtime import parallel
from megamu.runtime.device import CPU, Device
from megamu.training.host_mirror import HostMirror, device_tensors
from megamu.training.spill import spill, unspill

ADAM_STATES = ("exp_avg", "exp_avg_sq")
LR_DECAY_STYLES = ("constant", "linear", "cosine")
BUCKET_ELEMENTS = 2**25  # 128 MiB of fp32 gradients per data-parallel all-reduce


@dataclass(frozen=True)
class OptimizerConfig:
    """Megatron's flag names (--lr, --weight-decay, --adam-beta1, ..., --clip-grad, --lr-warmup-iters).

    The schedule is Megatron's (``--lr-warmup-iters``, ``--lr-decay-style``, ``--lr-decay-iters``, ``--min-lr``):
    update k (0-based) uses Megatron's lr at step k + 1, a linear warmup to ``lr`` then a constant, linear or cosine
    decay to ``min_lr`` over ``lr_decay_iters`` (``lr_at``). One step later than Megatron's count, whose first
    warmup update runs at lr 0. Weight decay skips biases and 1-D parameters (norms), as Megatron does.
    """

    lr: float = flag("--lr", default=1e-5, type=float)
    weight_decay: float = flag("--weight-decay", default=0.01, type=float)
    adam_beta1: float = flag("--adam-beta1", default=0.9, type=float)
    adam_beta2: float = flag("--adam-beta2", default=0.999, type=float)
    adam_eps: float = flag("--adam-eps", default=1e-8, type=float)
    clip_grad: float = flag("--clip-grad", default=1.0, type=float)  # 0 disables clipping
    lr_warmup_iters: int = flag("--lr-warmup-iters", default=0, type=int)
    # non-finite updates skipped in a row before the run stops (0: the first one stops it)
    max_skipped_steps: int = flag("--max-skipped-steps", default=5, type=int, help=(
        "updates with a non-finite gradient skipped in a row before the run stops"))
    lr_decay_style: str = flag("--lr-decay-style", default="constant", choices=LR_DECAY_STYLES)  # Megatron's
    # updates over which lr decays to min_lr (a run's: its length unless given)
    lr_decay_iters: int | None = flag("--lr-decay-iters", default=None, type=int, help="default: the run's updates")
    min_lr: float = flag("--min-lr", default=0.0, type=float, help="the lr a linear or cosine decay ends at")

    def __post_init__(self) -> None:
        if self.lr <= 0:
            raise ConfigError("lr", f"must be > 0, got {self.lr}")
        if self.clip_grad < 0:
            raise ConfigError("clip_grad", f"must be >= 0, got {self.clip_grad}")
        if self.lr_warmup_iters < 0:
            raise ConfigError("lr_warmup_iters", f"must be >= 0, got {self.lr_warmup_iters}")
        if self.max_skipped_steps < 0:
            raise ConfigError("max_skipped_steps", f"must be >= 0, got {self.max_skipped_steps}")
        for name in ("adam_beta1", "adam_beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise ConfigError(name, f"must be in [0, 1), got {getattr(self, name)}")
        if self.lr_decay_style not in LR_DECAY_STYLES:
            raise ConfigError("lr_decay_style", f"must be one of {LR_DECAY_STYLES}, got {self.lr_decay_style!r}")
        if not 0 <= self.min_lr <= self.lr:
            raise ConfigError("min_lr", f"must be in [0, lr = {self.lr}], got {self.min_lr}")
        # unset (None, or 0 as Megatron reads it): a run's RunConfig.derive sets the run's length, then checks again
        if self.lr_decay_style != "constant" and self.lr_decay_iters and self.lr_decay_iters <= self.lr_warmup_iters:
            raise ConfigError("lr_decay_iters", f"{self.lr_decay_iters} must exceed the warmup's "
                              f"{self.lr_warmup_iters} updates for a {self.lr_decay_style} decay")

    def lr_at(self, update: int) -> float:
        """Megatron's ``OptimizerParamScheduler.get_lr`` (init_lr 0) at step ``update + 1``."""
        step, warmup = update + 1, self.lr_warmup_iters
        if warmup and step <= warmup:
            return self.lr * step / warmup
        if self.lr_decay_style == "constant":
            return self.lr
        if not self.lr_decay_iters:
            raise ValueError(f"a {self.lr_decay_style} decay needs lr_decay_iters (a run's RunConfig derives it)")
        if step > self.lr_decay_iters:
            return self.min_lr
        ratio = (step - warmup) / (self.lr_decay_iters - warmup)
        coeff = 1.0 - ratio if self.lr_decay_style == "linear" else 0.5 * (math.cos(math.pi * ratio) + 1.0)
        return self.min_lr + coeff * (self.lr - self.min_lr)


def _no_weight_decay(name: str, param: torch.Tensor) -> bool:
    return name.endswith(".bias") or param.dim() == 1


class SkipCounter:
    """Skipped-update bookkeeping shared by both optimisers (checkpointed with the update count)."""

    def __init__(self, cfg: OptimizerConfig):
        self.cfg = cfg
        self.iteration = 0  # applied updates: drives the LR schedule (a skipped update does not advance it)
        self.skipped_steps = 0  # over the whole run
        self.skipped_in_a_row = 0
        self.last_step_skipped = False

    def _record(self, finite: bool, norm: float) -> None:
        self.last_step_skipped = not finite
        if finite:
            self.skipped_in_a_row = 0
            return
        self.skipped_steps += 1
        self.skipped_in_a_row += 1
        if self.skipped_in_a_row > self.cfg.max_skipped_steps:
            raise FloatingPointError(
                f"gradient norm is {norm} for the {self.skipped_in_a_row}th update in a row (after update "
                f"{self.iteration}); max_skipped_steps {self.cfg.max_skipped_steps} allows no more"
            )

    def state_dict(self) -> dict:
        return {"iteration": self.iteration, "skipped_steps": self.skipped_steps,
                "skipped_in_a_row": self.skipped_in_a_row}

    def _load_counts(self, state: dict) -> None:
        self.iteration = int(state["iteration"])
        self.skipped_steps = int(state.get("skipped_steps", 0))  # checkpoints written before skipping existed
        self.skipped_in_a_row = int(state.get("skipped_in_a_row", 0))


def build_optimizer(model: torch.nn.Module, cfg: OptimizerConfig, device: Device = CPU
                    ) -> TorchAdamW | MegatronDistributedAdam:
    """CPU -> TorchAdamW; CUDA -> megatron DDP + DistributedOptimizer (wraps ``model`` for gradient buffers)."""
    if device.is_cuda:
        return MegatronDistributedAdam(model, cfg)
    return TorchAdamW(model, cfg)


class TorchAdamW(SkipCounter):
    def __init__(self, model: torch.nn.Module, cfg: OptimizerConfig):
        super().__init__(cfg)
        self.model = model
        self.named_params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        decay = [p for n, p in self.named_params if not _no_weight_decay(n, p)]
        no_decay = [p for n, p in self.named_params if _no_weight_decay(n, p)]
        groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        self.opt = torch.optim.AdamW(
            [g for g in groups if g["params"]], lr=cfg.lr_at(0), betas=(cfg.adam_beta1, cfg.adam_beta2),
            eps=cfg.adam_eps,
        )
        self._spill_file = None

    def zero_grad(self) -> None:
        for _, p in self.named_params:
            p.grad = None

    def _all_reduce_grads(self) -> None:
        grads = []
        for _, p in self.named_params:
            if p.grad is None:  # a rank with no data this update still takes part in the reduction
                p.grad = torch.zeros_like(p)
            grads.append(p.grad)
        if parallel.dp_size() == 1:
            return
        # flat buckets: few collectives, and at most BUCKET_ELEMENTS of extra memory
        bucket: list[torch.Tensor] = []
        for i, g in enumerate(grads):
            bucket.append(g)
            if i == len(grads) - 1 or sum(t.numel() for t in bucket) + grads[i + 1].numel() > BUCKET_ELEMENTS:
                flat = torch._utils._flatten_dense_tensors(bucket)
                dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=parallel.dp_group())
                for t, synced in zip(bucket, torch._utils._unflatten_dense_tensors(flat, bucket)):
                    t.copy_(synced)
                bucket = []

    def _grad_norm(self) -> float:
        # TP-sharded parameters contribute every shard; replicated ones (norms) only from TP rank 0.
        first = parallel.tp_rank() == 0
        sq = torch.zeros((), dtype=torch.float64)
        for _, p in self.named_params:
            if getattr(p, "tensor_model_parallel", False) or first:
                sq += torch.linalg.vector_norm(p.grad.detach(), dtype=torch.float64) ** 2
        if parallel.tp_size() > 1:
            dist.all_reduce(sq, op=dist.ReduceOp.SUM, group=parallel.tp_group())
        return math.sqrt(float(sq))

    def step(self) -> tuple[float, float]:
        """All-reduce, clip, AdamW step. Returns (grad norm before clipping, learning rate used)."""
        from megamu.model import allreduce_tp_partial_grads

        allreduce_tp_partial_grads(self.model)  # Qwen3 q/k norms: each TP rank holds part of the gradient
        self._all_reduce_grads()
        norm = self._grad_norm()
        lr = self.cfg.lr_at(self.iteration)
        self._record(math.isfinite(norm), norm)
        if self.last_step_skipped:
            return norm, lr
        if self.cfg.clip_grad > 0:
            coeff = self.cfg.clip_grad / (norm + 1e-6)
            if coeff < 1.0:
                for _, p in self.named_params:
                    p.grad.mul_(coeff)
        for group in self.opt.param_groups:
            group["lr"] = lr
        self.opt.step()
        self.iteration += 1
        return norm, lr

    def load_state_dict(self, state: dict) -> None:
        self._load_counts(state)

    def _moments(self) -> list[torch.Tensor]:
        return adam_moments(st for _, p in self.named_params if (st := self.opt.state.get(p)))

    def offload(self, spill_dir: str | Path) -> None:
        """Free the gradients (the next update starts from ``zero_grad``) and spill the Adam moments to a file
        under ``spill_dir``; the parameters stay (the in-process engine and weight exports read them)."""
        if self._spill_file is not None:
            raise RuntimeError("offload: the optimiser state is already offloaded")
        for _, p in self.named_params:
            p.grad = None
        rank = dist.get_rank() if dist.is_initialized() else 0
        self._spill_file = Path(spill_dir) / f"adam-moments-rank{rank:05d}.bin"
        spill(self._moments(), self._spill_file)

    def reload(self) -> None:
        """The moments back from the spill file, bit for bit, into the same tensors."""
        if self._spill_file is None:
            raise RuntimeError("reload: nothing was offloaded")
        unspill(self._moments(), self._spill_file)
        self._spill_file = None

    def memory(self) -> TrainerMemory:
        device, seen = next(iter(p for _, p in self.named_params)).device, set()
        return TrainerMemory(
            params=storage_bytes((p for _, p in self.named_params), device, seen),
            grads=storage_bytes((p.grad for _, p in self.named_params), device, seen),
            moments=storage_bytes(self._moments(), device, seen),
        )

    def param_state(self, p: torch.Tensor, writes: bool = True) -> dict[str, torch.Tensor] | None:
        """{"step", "exp_avg", "exp_avg_sq"} of parameter ``p`` (this rank's TP shard), None before its first step.
        ``writes``: unused, the states are host tensors already (no copy is made)."""
        st = self.opt.state.get(p)
        return {"step": st["step"], **{k: st[k] for k in ADAM_STATES}} if st else None

    def load_param_state(self, p: torch.Tensor, state: dict[str, torch.Tensor]) -> None:
        self.opt.state[p] = {
            "step": torch.as_tensor(state["step"], dtype=torch.float32).clone(),
            **{k: state[k].to(dtype=p.dtype, device=p.device).clone() for k in ADAM_STATES},
        }


def adam_moments(states: Iterable[dict]) -> list[torch.Tensor]:
    """The Adam moments among optimiser per-parameter states: what ``offload`` moves and frees. Without TE or apex,
    megatron-core falls back to torch's AdamW, whose scalar ``step`` tensors start on the CPU and are moved to the GPU
    by ``restore_from_cpu``: counting them would make the memory after a reload look larger than before."""
    return [st[k] for st in states for k in ADAM_STATES if isinstance(st.get(k), torch.Tensor)]


class MegatronDistributedAdam(SkipCounter):
    """GPU path: megatron-core DDP + DistributedOptimizer. Tested by tests/gpu (skipped without CUDA, so not in CI).

    The model's weights are the truth until the first update: callers load HF or checkpoint weights AFTER building
    the optimiser, while megatron copies its fp32 main weights (bf16 models) at construction. They are re-copied from
    the model before the first step, unless a checkpoint restored them exactly (``load_param_state`` "main_param").
    """

    def __init__(self, model: torch.nn.Module, cfg: OptimizerConfig):
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.optimizer import OptimizerConfig as McoreOptimizerConfig
        from megatron.core.optimizer import get_megatron_optimizer

        super().__init__(cfg)
        self._mirror = HostMirror(pin=True)  # the optimiser's host copies, kept between refreshes
        config = model.config
        config.calculate_per_token_loss = True  # our loss is pre-scaled by global counts: DDP must sum, not average
        self.ddp = DistributedDataParallel(
            config,
            DistributedDataParallelConfig(
                grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=True,
                average_in_collective=False,
            ),
            module=model,
        )
        self.opt = get_megatron_optimizer(
            McoreOptimizerConfig(
                optimizer="adam", lr=cfg.lr_at(0), weight_decay=cfg.weight_decay, adam_beta1=cfg.adam_beta1,
                adam_beta2=cfg.adam_beta2, adam_eps=cfg.adam_eps, clip_grad=cfg.clip_grad, bf16=config.bf16,
                params_dtype=config.params_dtype, use_distributed_optimizer=True,
                # A constant scale of 1 changes no gradient, but only with a grad scaler does megatron check for
                # inf/nan (over all ranks) and skip the update; without one, bf16 steps on non-finite gradients.
                loss_scale=1.0,
            ),
            [self.ddp],
        )
        self._main_params_stale = True

    def _optimizers(self) -> list:
        return list(getattr(self.opt, "chained_optimizers", [self.opt]))

    def _sync_main_params(self) -> None:
        if self._main_params_stale:  # local copies, no collective
            self.opt.reload_model_params()
            self._main_params_stale = False

    def zero_grad(self) -> None:
        self.ddp.zero_grad_buffer()
        self.opt.zero_grad()

    def step(self) -> tuple[float, float]:
        from megatron.core.distributed import finalize_model_grads

        self._sync_main_params()
        finalize_model_grads([self.ddp])
        lr = self.cfg.lr_at(self.iteration)
        for group in self.opt.param_groups:
            group["lr"] = lr
            # megatron marks biases and 1-D parameters with wd_mult = 0, which only its LR scheduler applies
            group["weight_decay"] = self.cfg.weight_decay * group.get("wd_mult", 1.0)
        ok, norm, _ = self.opt.step()  # megatron found inf/nan over all ranks: nothing was changed
        self._record(bool(ok), float("nan") if norm is None else float(norm))
        if ok:
            self.iteration += 1
        return float("nan") if norm is None else float(norm), lr

    def load_state_dict(self, state: dict) -> None:
        self._load_counts(state)
        for group in self.opt.param_groups:
            group["step"] = self.iteration  # TE FusedAdam's bias correction counter

    def _owner(self, p: torch.Tensor):
        for opt in self._optimizers():
            if p in getattr(opt, "model_param_group_index_map", {}):
                return opt
        return None

    def param_state(self, p: torch.Tensor, writes: bool = True) -> dict[str, torch.Tensor]:
        """Adam moments, plus the fp32 "main_param" where it differs from the model's (bf16) weight: fp32 HOST tensors
        of ``p``'s shape, assembled chunk by chunk (``optimizer_shards``: one bounded device buffer, not a full copy
        of the optimiser state on the GPU), on the rank that ``writes`` ``p``'s shard; the others get the "step"
        alone and stage nothing."""
        # Each DP rank owns a contiguous range of every flattened parameter; summing the zero-filled pieces over the
        # DP group rebuilds the full (TP-local) tensor: a collective, so every rank calls it for every parameter.
        from megamu.training.optimizer_shards import assemble_dp_sharded

        self._sync_main_params()  # a checkpoint before the first update must not save the construction-time copy
        opt = self._owner(p)
        keys = ADAM_STATES + (("main_param",) if p.dtype != torch.float32 else ())
        start = end = 0
        local: dict[str, torch.Tensor] = {}
        if opt is not None:
            rng = opt._get_model_param_range_map(p)["param"]
            start, end = rng.start, rng.end
            local = opt._get_main_param_and_optimizer_states(p)  # moments are absent before the first update
            local = {**local, "main_param": local["param"]}
        # expert parameters (megatron marks them allreduce=False at EP > 1) are sharded over the expert-data-parallel
        # group, whose ranks hold the same experts, not over the data-parallel group
        group = parallel.dp_group() if getattr(p, "allreduce", True) else parallel.expert_dp_group()
        full = assemble_dp_sharded(p.numel(), start, end, local, keys, group, p.device, writes=writes) or {}
        return {"step": torch.tensor(float(self.iteration)), **{k: v.view(p.shape) for k, v in full.items()}}

    def load_param_state(self, p: torch.Tensor, state: dict[str, torch.Tensor]) -> None:
        # Call after the model weights are loaded: without a saved "main_param" the fp32 main copy is rebuilt from them.
        # fp32 parameters are their own main copy (megatron shards views of them), so they keep the loaded weights.
        restore_main = "main_param" in state and p.dtype != torch.float32
        if restore_main:
            self._main_params_stale = False
        opt = self._owner(p)
        if opt is None:
            return
        if "exp_avg" not in opt._get_main_param_and_optimizer_states(p):
            opt.init_state_fn(opt.optimizer, opt.config)  # megatron's Adam creates its moments lazily
        from megamu.training.optimizer_shards import load_dp_range

        rng = opt._get_model_param_range_map(p)["param"]
        local = opt._get_main_param_and_optimizer_states(p)
        main = state["main_param"] if restore_main else p.detach()
        # slice on the host, then move: only this rank's range of a loaded (host) state reaches the GPU
        tensors = {"param": load_dp_range(main, rng.start, rng.end, local["param"])}
        for k in ADAM_STATES:
            tensors[k] = load_dp_range(state[k], rng.start, rng.end, local[k])
        opt._set_main_param_and_optimizer_states(p, {**tensors, **({"step": local["step"]} if "step" in local else {})})
        if isinstance(opt.optimizer, (torch.optim.Adam, torch.optim.AdamW)):  # per-parameter step (TE's: per group)
            opt.optimizer.state[local["param"]]["step"] = torch.as_tensor(state["step"], dtype=torch.float32).clone()

    # --- offload around a rollout (megatron-core 0.16.1's own hooks; views into the flat buffers stay valid) ---

    def _buffers(self) -> list:
        return list(self.ddp.buffers) + list(self.ddp.expert_parallel_buffers)

    def offload(self, spill_dir: str | Path | None = None) -> None:
        """Parameters, gradient buffers, fp32 main parameters and Adam moments leave the GPU (to pinned host memory).

        Order matters: the optimiser goes first, since fp32 parameters' main shards are views into the parameter
        buffer that the buffer offload empties. ``spill_dir`` is unused (host memory holds the copies)."""
        torch.cuda.synchronize()
        self.opt.zero_grad()  # main-param .grad views into the grad buffer; the next update starts from zero
        # megatron's offload_to_cpu, into pinned host buffers reused by every refresh
        self._mirror.offload(device_tensors(o.optimizer for o in self._optimizers()))
        self.ddp.offload_grad_buffers(synchronize=False, empty_cache=False)
        for buffer in self._buffers():
            buffer.offload_to_cpu(move_params=True, move_grads=False)
        torch.cuda.synchronize()  # the copies to host are non-blocking
        torch.cuda.empty_cache()

    def reload(self) -> None:
        """Everything back on the GPU, bitwise; gradient buffers come back zeroed."""
        for buffer in self._buffers():
            buffer.reload_from_cpu(move_params=True, move_grads=False)
        self.ddp.restore_grad_buffers(synchronize=False)
        self._mirror.reload()
        torch.cuda.synchronize()

    def memory(self) -> TrainerMemory:
        device, seen = torch.device("cuda", torch.cuda.current_device()), set()
        buffers = self._buffers()
        groups = [g for opt in self._optimizers() for g in opt.optimizer.param_groups]
        main = [p for g in groups for p in g["params"]]
        states = adam_moments(st for opt in self._optimizers() for st in opt.optimizer.state.values())
        return TrainerMemory(
            params=storage_bytes([b.param_data for b in buffers] + list(self.ddp.module.parameters()), device, seen),
            grads=storage_bytes([b.grad_data for b in buffers], device, seen),
            main_params=storage_bytes(main, device, seen),
            moments=storage_bytes(states, device, seen),
        )
