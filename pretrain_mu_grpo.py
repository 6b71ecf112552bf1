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

from megamu.arguments import check_memory, parse_args
from megamu.memory.memory_plan import plan_memory
from megamu.run.run_lock import RunDirLocked, RunLock

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
    from megamu.loop.trainer import Trainer

    # one run per --save: a second launch on it stops here, before it writes anything (rank 0 holds the lock)
    try:
        with RunLock(cfg.save) if os.environ.get("RANK", "0") == "0" else nullcontext() as lock:
            if lock and lock.taken_over:
                print(f"--save {cfg.save}: took over the lock of a run that is gone ({lock.taken_over})", flush=True)
            trainer = Trainer(cfg)  # the process groups, the policy, the prompts, the progress (resumed if saved)
            try:
                trainer.train()  # the mode's loop, its final evaluation, the summary
            finally:
                trainer.close()
    except RunDirLocked as e:
        raise SystemExit(str(e)) from None


if __name__ == "__main__":
    main()
