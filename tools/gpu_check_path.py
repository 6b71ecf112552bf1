"""tools/gpu_check.py's checks of the colocated GPU path (issue #32): the memory plan against the allocator's
measured peaks, the push-bucket allocation, and the expert-parallel micro-batch agreement at EP = 1.

  plan      a Qwen2.5-0.5B-shaped model (local spec, bf16, megatron DDP + DistributedOptimizer) trained at two
            micro-batch sizes, without and with full recompute: the plan's trainer state and its per-step
            activations + logits against ``torch.cuda.max_memory_allocated`` (context excluded on both sides). The
            plan must not under-estimate; more than 2x over is reported as loose (still a pass).
  buckets   a push bucket flattened under ``expandable_segments:True`` lands in a non-expandable segment (a plain CUDA
            IPC handle, no pidfd_getfd), and torch exports it
  plan te   the same at one micro-batch size on Transformer Engine's spec, where transformer_engine imports (skip
            with the reason otherwise)
  ep-agree  at EP 2 (a torchrun world of 2, tiny Qwen3-MoE): a rank with nothing to train still enters the other's
            number of passes; skip with the reason on one GPU

``compare`` is pure (tested on CPU); the rest needs megatron and, for the numbers, a GPU (``cuda=False``: the same
code on the CPU, where ``max_memory_allocated`` does not exist, so the plan rows only report the plan).
"""

from __future__ import annotations

import gc
import importlib.util
from dataclasses import dataclass
from pathlib import Path

from tools.gpu_check_compare import Row, compare_peaks, size


def run_world(script_args: list[str], what: str, timeout: int = 300, **env: str) -> str | None:
    """Run a torchrun world of 2 ranks of its own (``script_args``: the worker and its arguments); None when it
    exited 0, else why not. This process's own world (gpu_check's, of one) must not leak its rendezvous into it."""
    import os
    import subprocess
    import sys

    clean = {k: v for k, v in os.environ.items()
             if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    clean.update(env)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", *script_args]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=clean)
    except subprocess.TimeoutExpired:
        return f"{what} did not finish in {timeout} s (a rank left waiting in a collective)"
    if proc.returncode != 0:
        return f"{what} failed ({proc.returncode}): {proc.stderr.strip().splitlines()[-1:]}"
    return None

LOOSE = 2.0  # planned / measured above this: the plan is safe but loose, worth a look


@dataclass(frozen=True)
class PlanPoint:
    micro_batch_size: int
    recompute: str | None
    planned_state: int
    planned_step: int
    measured_state: int | None = None
    measured_step: int | None = None
    planned_logits: int = 0  # the plan's logits term (part of planned_step)
    measured_logits: int | None = None  # token_logprobs alone at the plan's scored tokens (logits_peak)
    transformer_impl: str = "local"

    def terms(self) -> tuple[dict[str, int], dict[str, int | None]]:
        """(planned, measured) activation and logits terms: the step's peak less the logits' own is the activations'
        (the plan adds the two: the logits are formed while the activations are held)."""
        planned = {"activations": self.planned_step - self.planned_logits, "logits": self.planned_logits}
        if self.measured_step is None or self.measured_logits is None:
            return planned, {"activations": None, "logits": None}
        return planned, {"activations": self.measured_step - self.measured_logits, "logits": self.measured_logits}


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
               samples, transformer_impl: str = "local") -> PlanPoint:
    """Train one update to create the Adam state, then measure the next one's peak above the resident state."""
    import torch

    from megamu.algo import ALGORITHM_PRESETS
    from megamu.memory.memory_plan import MemoryPlanConfig, ModelShape, padded_vocab, plan_memory
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
        model = build_model(arch, device=Device("cuda"), transformer_impl=transformer_impl, bf16=True,
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
        transformer_impl=transformer_impl, rollout_mode="async"))
    rows = {r.part: r.bytes for r in plan.rows() if r.phase == "training" and r.counted}
    planned_state = sum(b for part, b in rows.items() if part.startswith(("params", "fp32", "Adam")))
    planned_step = sum(b for part, b in rows.items() if part.startswith(("activations", "logits")))
    planned_logits = sum(b for part, b in rows.items() if part.startswith("logits"))
    logits = logits_peak(plan.config.scored_tokens, padded_vocab(config.vocab_size, 1)) if cuda else None
    return PlanPoint(mbs, recompute, planned_state, planned_step, state, step, planned_logits, logits,
                     transformer_impl)


def logits_peak(scored_tokens: int, vocab: int) -> int:
    """The allocator's peak of megamu's log-probs and entropy over fp32 logits [scored_tokens, vocab] (the output
    layer's, as Float16Module hands them on), the logits included: what the plan's logits term counts."""
    import torch

    from megamu.model.logprobs import token_logprobs

    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    logits = torch.randn(scored_tokens, vocab, device="cuda", dtype=torch.float32, requires_grad=True)
    targets = torch.randint(0, vocab, (scored_tokens,), device="cuda")
    logp, entropy = token_logprobs(logits, targets, with_entropy=True)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del logits, targets, logp, entropy
    return peak


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


EP_WORKER = Path(__file__).resolve().parents[1] / "tests" / "training" / "workers" / "ep_agree_worker.py"


def ep_agree_verdict(rows: list[list[float]]) -> tuple[bool, str]:
    """The EP-2 worker's rows, one per rank: (training passes, log-prob passes, real micro-batches, non-expert
    gradient, expert gradient). Rank 0's share is all zero-advantage: it must still enter rank 1's number of passes
    (padding, zero gradient outside the experts) and both ranks two log-prob passes."""
    (train0, lp0, real0, grad0, _), (train1, lp1, real1, grad1, experts1) = rows
    ok = real0 == 0 and real1 > 0 and train0 == train1 == real1 and grad0 == 0.0 and grad1 > 0.0 \
        and experts1 > 0.0 and lp0 == lp1 == 2
    return ok, f"EP 2: passes {train0}/{train1} (real {real0}/{real1}), log-prob passes {lp0}/{lp1}"


def ep_agreement(cuda: bool) -> tuple[bool | None, str]:
    """The micro-batch agreement at EP 2 with a tiny Qwen3-MoE (tests/training/workers/ep_agree_worker.py, a
    torchrun world of 2): on CUDA the device's own spec and dispatcher (alltoall); on the CPU megatron's alltoall
    dispatcher through tests/cpu_cuda_shim.py. None (skip) with the reason on a machine with one GPU: EP 1 enters
    no collective, so a pass there would prove nothing."""
    import json
    import tempfile

    import torch

    if cuda and torch.cuda.device_count() < 2:
        return None, f"needs 2 GPUs for EP 2, this machine has {torch.cuda.device_count()}"
    from tests.tiny import save_tiny_model

    with tempfile.TemporaryDirectory(prefix="ep-agree-") as tmp:
        hf, out = Path(tmp) / "hf", Path(tmp) / "rows.json"
        save_tiny_model(hf, "qwen3_moe", 0)
        failed = run_world([str(EP_WORKER), str(hf), str(out)] + ([] if cuda else ["alltoall"]), "EP 2 world",
                           OMP_NUM_THREADS="1")
        if failed:
            return False, failed
        return ep_agree_verdict(json.loads(out.read_text()))


def path_rows(args, cuda: bool, only: set[str], measured: list, config, samples) -> list[Row]:
    """The colocated path's checks (tools/gpu_check_path.py): plan vs measured peaks, push buckets, EP agreement.
    ``measured``: the plan rows' measured activation and logits terms are appended (MeasuredTerm); ``config``
    and ``samples``: the model and data the plan rows train."""
    rows = []
    if "plan" in only:
        for mbs in (args.micro_batch_size // 2 or 1, args.micro_batch_size):
            for recompute in (None, "full"):
                p = plan_point(config, mbs, recompute, args.seq_len, args.seq_len // 4, cuda, samples)
                rows.append(plan_row(f"plan mb{mbs}{'-rc' if recompute else ''}", p, measured))
        rows.append(te_plan_row(args, cuda, config, samples, measured))
    if "buckets" in only:
        rows.append(Row("buckets", *bucket_is_shareable(cuda)))
    if "ep-agree" in only:
        ok, verdict = ep_agreement(cuda)
        rows.append(Row("ep-agree", bool(ok), verdict, skipped=ok is None))
    return rows


def plan_row(check: str, p: PlanPoint, measured: list) -> Row:
    """The state and step against the plan (gpu_check_path.compare), and each measured term (activations, logits)
    against its planned term (gpu_check_compare.compare_peaks); the measured terms go to ``measured``."""
    from megamu.memory.measured_peaks import MeasuredTerm

    ok, verdict = compare(p)
    detail = f"state + step: planned {size(p.planned_state)} + {size(p.planned_step)}"
    if p.measured_state is not None:
        detail += f", measured {size(p.measured_state)} + {size(p.measured_step)}"
    planned, got = p.terms()
    if got["logits"] is not None:
        terms_ok, said = compare_peaks(planned, got)
        ok, detail = ok and terms_ok, f"{detail}; {said}"
        measured += [MeasuredTerm(p.transformer_impl, t, planned[t], max(got[t], 1)) for t in planned if planned[t]]
    return Row(check, ok, verdict, detail)


def te_plan_row(args, cuda: bool, config, samples, measured: list) -> Row:
    """The plan against the allocator on Transformer Engine's spec (the spec GPU runs use), where TE imports."""
    if importlib.util.find_spec("transformer_engine") is None:
        return Row("plan te", False, "transformer_engine is not installed", skipped=True)
    if not cuda:
        return Row("plan te", False, "Transformer Engine runs on CUDA only", skipped=True)
    p = plan_point(config, args.micro_batch_size, None, args.seq_len, args.seq_len // 4, cuda, samples,
                        transformer_impl="transformer_engine")
    return plan_row("plan te", p, measured)
