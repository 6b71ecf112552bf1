"""μ-GRPO: staged high-staleness GRPO (arXiv 2605.17570, §4). `torchrun --nproc_per_node N pretrain_mu_grpo.py [flags]`.

Each stage k: freeze θ_k as β_k -> generate one static rollout dataset D_k with per-token behaviour log-probs ->
release the engine -> run μ optimiser updates on D_k. Weights reach the engine only at stage boundaries.
Run with no flags for the CPU demo; rerun the same command to resume.
"""

import os
import time
import warnings

import torch

from megamu import parallel
from megamu.arguments import parse_args

# megatron-core announces its fallbacks when Apex/TE are absent (always, on CPU); they are expected, not actionable.
warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine|cuda_graph_scope).*")


def main(argv=None) -> None:
    cfg = parse_args(argv)
    if os.environ.get("RANK", "0") == "0":
        print("μ-GRPO plan:\n" + cfg.describe() + "\n" + cfg.plan.json_line(), flush=True)
    if cfg.dry_run:
        return
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        torch.set_num_threads(1)  # torchrun ranks share the cores; spinning OpenMP workers slow everyone down
    parallel.init_distributed(cfg.tensor_model_parallel_size, cfg.seed, cfg.device)
    from megamu.trainer import Run

    run = Run(cfg)
    policy, rollout, prompts = run.policy, run.rollout, run.prompts
    for stage in range(run.stage, cfg.plan.num_stages):
        t0 = time.perf_counter()
        rollout.sync(policy, stage)  # 1. freeze θ_k as the behaviour policy β_k
        t1 = time.perf_counter()
        dataset = rollout.generate(stage, prompts.for_stage(stage), policy)  # 2. β_k generates D_k
        t2 = time.perf_counter()
        run.optimise(stage, dataset)  # 3. μ updates on the static D_k
        run.log_stage(stage, dataset, t_export=t1 - t0, t_rollout=t2 - t1, t_train=time.perf_counter() - t2)
    run.finish()
    parallel.destroy_distributed()


if __name__ == "__main__":
    main()
