"""Megatron-LM and slime flags that a user's launch script carries over: accepted at the values megamu runs with,
checked where they state something megamu can verify, refused with the reason where megamu has no such feature.

A flag accepted here changes nothing; a value megamu cannot honour is an error naming the flag, never ignored.
"""

from __future__ import annotations

import argparse

from megamu.arguments.engine import _error


def add_megatron_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("Megatron-LM flags megamu accepts at their single supported value (or checks)")
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1,
                   help="1 only: megamu's actors are tensor (and expert) parallel, without pipeline stages")
    g.add_argument("--context-parallel-size", type=int, default=1,
                   help="1 only: a sequence stays on one rank of its tensor-parallel group")
    g.add_argument("--use-distributed-optimizer", action="store_true",
                   help="accepted: on GPUs megamu always shards the optimiser state over data-parallel ranks "
                        "(megatron-core's DistributedOptimizer); the CPU path has one full copy per rank")
    g.add_argument("--global-batch-size", type=int, default=None,
                   help="samples per optimiser update (Megatron-LM's and slime's meaning): checked against "
                        "--prompts-per-update x --n-samples-per-prompt")


def check_megatron_arguments(args: argparse.Namespace, prompts_per_update: int) -> None:
    """Errors for the values megamu cannot run; ``prompts_per_update`` is the plan's B_mini."""
    for flag, value in (("--pipeline-model-parallel-size", args.pipeline_model_parallel_size),
                        ("--context-parallel-size", args.context_parallel_size)):
        if value != 1:
            _error(flag, f"megamu runs {flag[2:].replace('-', ' ')} 1 only, got {value}: use "
                         "--tensor-model-parallel-size (and --expert-model-parallel-size for MoE) to split the model")
    samples = prompts_per_update * args.n_samples_per_prompt
    if args.global_batch_size is not None and args.global_batch_size != samples:
        _error("--global-batch-size", f"{args.global_batch_size} samples per update contradicts "
                                      f"--prompts-per-update {prompts_per_update} x --n-samples-per-prompt "
                                      f"{args.n_samples_per_prompt} = {samples} (give --prompts-per-update "
                                      f"{args.global_batch_size // max(args.n_samples_per_prompt, 1)} or drop it)")
