"""Megatron-LM and slime flags that a user's launch script carries over: accepted at the values megamu runs with,
checked where they state something megamu can verify, refused with the reason where megamu has no such feature.

A flag accepted here changes nothing; a value megamu cannot honour is an error naming the flag, never ignored.
"""

from __future__ import annotations

import argparse

from megamu.arguments.flag_errors import flag_error

# megatron-core's hybrid device optimizer (optimizer/__init__.py:306-336: Adam on the host with optimizer_cpu_offload)
# and its companions, as slime's run-qwen3-30B-A3B.sh passes them: accepted, not applied (optimizer_offload_note)
OPTIMIZER_OFFLOAD = ("--optimizer-cpu-offload", "--overlap-cpu-optimizer-d2h-h2d", "--use-precision-aware-optimizer")
OFFLOAD_HELP = ("accepted, not applied: megamu keeps the optimiser on the GPUs during updates and moves it to the host "
                "between them (--offload-train); the start-up note gives the GiB it would save")


def add_megatron_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("Megatron-LM flags megamu accepts at their single supported value (or checks)")
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1,
                   help="1 only: megamu's actors are tensor (and expert) parallel, without pipeline stages")
    g.add_argument("--context-parallel-size", type=int, default=1,
                   help="1 only: a sequence stays on one rank of its tensor-parallel group")
    g.add_argument("--use-distributed-optimizer", action="store_true",
                   help="accepted: on GPUs megamu always shards the optimiser state over data-parallel ranks "
                        "(megatron-core's DistributedOptimizer); the CPU path has one full copy per rank")
    for name in OPTIMIZER_OFFLOAD:
        g.add_argument(name, action="store_true", help=OFFLOAD_HELP)
    g.add_argument("--global-batch-size", type=int, default=None,
                   help="samples per optimiser update (Megatron-LM's and slime's meaning): checked against "
                        "--prompts-per-update x --n-samples-per-prompt")


def check_megatron_arguments(args: argparse.Namespace, prompts_per_update: int) -> None:
    """Errors for the values megamu cannot run; ``prompts_per_update`` is the plan's B_mini."""
    for flag, value in (("--pipeline-model-parallel-size", args.pipeline_model_parallel_size),
                        ("--context-parallel-size", args.context_parallel_size)):
        if value != 1:
            flag_error(flag, f"megamu runs {flag[2:].replace('-', ' ')} 1 only, got {value}: use "
                             "--tensor-model-parallel-size (and --expert-model-parallel-size for MoE) to split the "
                             "model")
    samples = prompts_per_update * args.n_samples_per_prompt
    if args.global_batch_size is not None and args.global_batch_size != samples:
        flag_error("--global-batch-size", f"{args.global_batch_size} samples per update contradicts "
                                          f"--prompts-per-update {prompts_per_update} x --n-samples-per-prompt "
                                          f"{args.n_samples_per_prompt} = {samples} (give --prompts-per-update "
                                          f"{args.global_batch_size // max(args.n_samples_per_prompt, 1)} or drop it)")


def optimizer_offload_note(args: argparse.Namespace, memory) -> list[str]:
    """The start-up line for megatron's optimiser-offload flags (``OPTIMIZER_OFFLOAD``), with this run's numbers.

    megatron-core's hybrid device optimizer keeps the fp32 main params and Adam moments on the host and steps them
    there (optimizer/__init__.py:306-336, cpu_offloading/hybrid_optimizer.py), so that they never take GPU memory.
    megamu keeps them on the GPUs while it updates and moves them (with the gradients and weights) to the host while
    the rollout has the GPUs (``--offload-train``, on by default in staged and colocated modes): the phase in which a
    colocated launch such as slime's needs the room. The flags are accepted and not applied; the line gives the GiB
    per GPU the hybrid optimizer would take off the training phase, and that phase's total, from the memory plan
    (``memory``: the run's MemoryPlanConfig, None when no plan is made, e.g. a CPU run, whose optimiser is on the host
    already). A training phase that does not fit is the memory plan's error, naming what fits."""
    given = [f for f in OPTIMIZER_OFFLOAD if getattr(args, f[2:].replace("-", "_"))]
    if not given:
        return []
    head = f"{', '.join(given)}: accepted, not applied (megamu does not run megatron-core's hybrid device optimizer)"
    if memory is None:
        return [f"{head}: no GPU memory plan here; a CPU run keeps its optimiser on the host already"]
    from megamu.memory.memory_plan import GIB, plan_memory

    plan = plan_memory(memory)
    state = sum(r.bytes for r in plan.rows() if r.phase == "training"
                and r.counted and r.part.startswith(("fp32 main params", "Adam moments"))) / GIB
    peak = plan.total("training") / GIB
    between = ("moves it to the host while the rollout has the GPUs (--offload-train)" if memory.offload_train else
               "keeps it there between updates too (--offload-train is off here)")
    return [f"{head}: the optimiser state stays on the GPUs during updates, {state:.1f} GiB per GPU here (fp32 main "
            f"params + Adam moments; training phase {peak:.1f} of {memory.gpu_memory_gib:.1f} GiB), and megamu "
            f"{between}. megatron's hybrid optimizer would take those {state:.1f} GiB off the training phase "
            f"({peak - state:.1f} GiB) at the price of Adam steps on the host"]
