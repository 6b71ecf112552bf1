"""μ-GRPO: staged high-staleness GRPO (arXiv 2605.17570, §4). `torchrun --nproc_per_node N pretrain_mu_grpo.py [flags]`.

Each stage k: freeze θ_k as β_k -> generate one static rollout dataset D_k with per-token behaviour log-probs ->
release the engine -> run μ optimiser updates on D_k. Weights reach the engine only at stage boundaries.
With --rollout-mode async (§5.1) an engine process generates while the trainer trains, within a bounded policy lag.
Run with no flags for the CPU demo; rerun the same command to resume.
"""

import os
import sys
import warnings
from contextlib import nullcontext

import torch

from megamu.arguments import check_memory, parse_args
from megamu.memory.memory_plan import plan_memory
from megamu.run.run_lock import RunDirLocked, RunLock
from megamu.runtime import parallel

# megatron-core announces its fallbacks when Apex/TE are absent (always, on CPU); they are expected, not actionable.
warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine|cuda_graph_scope).*")


def main(argv=None) -> None:
    cfg = parse_args(argv)
    memory = plan_memory(cfg.memory) if cfg.memory else None
    if os.environ.get("RANK", "0") == "0":
        print("μ-GRPO plan:\n" + cfg.describe(), flush=True)
        if memory:
            print(memory.table(), flush=True)
        print(cfg.plan.json_line(), flush=True)
    if memory:
        # a plan that cannot fit the device stops here, naming the line that overflows and the flags that fit
        check_memory(memory, sys.argv[1:] if argv is None else argv)
    if cfg.dry_run:
        return
    # one run per --save: a second launch on it stops here, before it writes anything (rank 0 holds the lock)
    try:
        with RunLock(cfg.save) if os.environ.get("RANK", "0") == "0" else nullcontext() as lock:
            if lock and lock.taken_over:
                print(f"--save {cfg.save}: took over the lock of a run that is gone ({lock.taken_over})", flush=True)
            train(cfg)
    except RunDirLocked as e:
        raise SystemExit(str(e)) from None


def train(cfg) -> None:
    if cfg.cpu_threads:
        torch.set_num_threads(cfg.cpu_threads)  # CPU async: the engine process has the other cores
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        torch.set_num_threads(1)  # torchrun ranks share the cores; spinning OpenMP workers slow everyone down
    parallel.init_distributed(cfg.tensor_model_parallel_size, cfg.seed, cfg.device,
                              distributed_timeout_minutes=cfg.distributed_timeout_minutes,
                              expert_model_parallel_size=cfg.expert_model_parallel_size)
    from megamu.loop.async_ import train_async
    from megamu.loop.staged import train_staged
    from megamu.loop.trainer import Trainer

    trainer = Trainer(cfg)  # the policy, the prompts, the run's progress: resumed from the last checkpoint if any
    if trainer.mode.streams:  # §5.1: an engine process streams groups while the trainer trains
        train_async(trainer)
    else:  # §4, every stage k: publish θ_k, offload, generate D_k, onload, prune, μ updates on D_k
        train_staged(trainer)
    trainer.finish()
    parallel.destroy_distributed()


if __name__ == "__main__":
    main()
