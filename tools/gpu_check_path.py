"""tools/gpu_check.py's checks of the colocated GPU path (issue #32): the memory plan against the allocator's
measured peaks, the push-bucket allocation, and the expert-parallel micro-batch agreement at EP = 1.

  plan      a Qwen2.5-0.5B-shaped model (local spec, bf16, megatron DDP + DistributedOptimizer) trained at two
            micro-batch sizes, without and with full recompute: the plan's trainer state and its per-step
            activations + logits against ``torch.cuda.max_memory_allocated`` (context excluded on both sides). The
            plan must not under-estimate; more than 2x over is reported as loose (still a pass).
  buckets   a push bucket flattened under ``expandable_segments:True`` lands in a non-expandable segment (a plain CUDA
            IPC handle, no pidfd_getfd), and torch exports it
  ep-agree  at EP = 1 the agreement is the rank's own count and enters no collective

``compare`` is pure (tested on CPU); the rest needs megatron and, for the numbers, a GPU (``cuda=False``: the same
code on the CPU, where ``max_memory_allocated`` does not exist, so the plan rows only report the plan).
"""

from __future__ import annotations

import gc
from dataclasses import dataclass

LOOSE = 2.0  # planned / measured above this: the plan is safe but loose, worth a look


@dataclass(frozen=True)
class PlanPoint:
    micro_batch_size: int
    recompute: str | None
    planned_state: int
    planned_step: int
    measured_state: int | None = None
    measured_step: int | None = None


def compare(p: PlanPoint) -> tuple[bool, str]:
    """(ok, verdict): ok when neither planned part is below its measurement (nothing measured: ok, "plan only")."""
    if p.measured_state is None or p.measured_step is None:
        return True, "plan only (no CUDA allocator)"
    under = [name for name, plan, got in (("state", p.planned_state, p.measured_state),
                                          ("step", p.planned_step, p.measured_step)) if plan < got]
    if under:
        return False, "UNDER-estimates " + ", ".join(under)
    ratio = (p.planned_state + p.planned_step) / max(p.measured_state + p.measured_step, 1)
    return True, f"covers ({ratio:.2f}x{', loose' if ratio > LOOSE else ''})"


def plan_point(config, mbs: int, recompute: str | None, seq_len: int, prompt_len: int, cuda: bool,
               samples) -> PlanPoint:
    """Train one update to create the Adam state, then measure the next one's peak above the resident state."""
    import torch

    from megamu.algo import ALGORITHM_PRESETS
    from megamu.memory.memory_plan import MemoryPlanConfig, ModelShape, plan_memory
    from megamu.model import ModelArch, build_model
    from megamu.runtime.device import Device
    from megamu.training import OptimizerConfig, build_optimizer
    from megamu.training.step import train_step

    state = step = None
    if cuda:  # megatron's full recompute needs CUDA's RNG tracker: on the CPU only the plan is shown
        arch = ModelArch.from_hf(config)
        gc.collect()
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()
        model = build_model(arch, device=Device("cuda"), transformer_impl="local", bf16=True,
                            recompute_granularity=recompute)
        opt = build_optimizer(model, OptimizerConfig(lr=1e-6), Device("cuda"))
        algo = ALGORITHM_PRESETS["mu-grpo"]
        train_step(model, opt, samples, algo, micro_batch_size=mbs)  # the first update creates the Adam moments
        torch.cuda.synchronize()
        state = torch.cuda.memory_allocated() - base
        torch.cuda.reset_peak_memory_stats()
        resident = torch.cuda.memory_allocated()
        train_step(model, opt, samples, algo, micro_batch_size=mbs)
        torch.cuda.synchronize()
        step = torch.cuda.max_memory_allocated() - resident
        del model, opt
    plan = plan_memory(MemoryPlanConfig(
        model=ModelShape.from_hf_config(config.to_dict()), micro_batch_size=mbs, max_seq_len=seq_len,
        max_response_len=seq_len - prompt_len, params_dtype="bf16", recompute_granularity=recompute,
        transformer_impl="local", rollout_mode="async"))
    rows = {r.part: r.bytes for r in plan.rows() if r.phase == "training" and r.counted}
    planned_state = sum(b for part, b in rows.items() if part.startswith(("params", "fp32", "Adam")))
    planned_step = sum(b for part, b in rows.items() if part.startswith(("activations", "logits")))
    return PlanPoint(mbs, recompute, planned_state, planned_step, state, step)


def bucket_is_shareable(cuda: bool) -> tuple[bool, str]:
    """A bucket flattened with expandable segments on: its segment must not be expandable, and torch exports it."""
    import torch
    import torch.multiprocessing.reductions as reductions

    from megamu.engines.sglang.tensor_sync import serialize_bucket

    if not cuda:
        _, flat = serialize_bucket([("w", torch.ones(8))])
        return flat.numel() == 32, "CPU: shared-memory file (no CUDA IPC here)"
    import os

    old = os.environ.get("PYTORCH_CUDA_ALLOC_CONF")
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"  # what megamu.runtime.device reads
    torch.cuda.memory._set_allocator_settings("expandable_segments:True")
    try:
        w = torch.randn(4096, 1024, device="cuda", dtype=torch.bfloat16)
        _, flat = serialize_bucket([("w", w)])
        ptr = flat.untyped_storage().data_ptr()
        segments = [s for s in torch.cuda.memory_snapshot()
                    if s["address"] <= ptr < s["address"] + s["total_size"]]
        expandable = bool(segments and segments[0].get("is_expandable", False))
        reductions.reduce_tensor(flat)
        return not expandable, f"bucket segment expandable={expandable}, {flat.numel() / 2**20:.0f} MiB exported"
    finally:
        torch.cuda.memory._set_allocator_settings("expandable_segments:False")
        if old is None:
            os.environ.pop("PYTORCH_CUDA_ALLOC_CONF", None)
        else:
            os.environ["PYTORCH_CUDA_ALLOC_CONF"] = old


def ep_agreement(cuda: bool) -> tuple[bool, str]:
    """At EP = 1 (one GPU): each count is its own, no collective entered."""
    import torch

    from megamu.runtime import parallel

    device = torch.device("cuda" if cuda else "cpu")
    counts = [parallel.ep_agreed_count(n, device) for n in (0, 1, 7)]
    return parallel.ep_size() == 1 and counts == [0, 1, 7], f"EP {parallel.ep_size()}: agreed counts {counts}"
