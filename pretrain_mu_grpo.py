"""μ-GRPO: staged high-staleness GRPO (arXiv 2605.17570, §4). `torchrun --nproc_per_node N pretrain_mu_grpo.py [flags]`.

Each stage k: freeze θ_k as β_k -> generate one static rollout dataset D_k with per-token behaviour log-probs ->
release the engine -> run μ optimiser updates on D_k. Weights reach the engine only at stage boundaries.
With --rollout-mode async (§5.1) an engine process generates while the trainer trains, within a bounded policy lag.
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
    if cfg.cpu_threads:
        torch.set_num_threads(cfg.cpu_threads)  # CPU async: the engine process has the other cores
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        torch.set_num_threads(1)  # torchrun ranks share the cores; spinning OpenMP workers slow everyone down
    parallel.init_distributed(cfg.tensor_model_parallel_size, cfg.seed, cfg.device,
                              distributed_timeout_minutes=cfg.distributed_timeout_minutes)
    from megamu.trainer import Run

    run = Run(cfg)
    if cfg.plan.rollout_mode == "async":
        train_async(run)
    else:
        train_staged(run)
    run.finish()
    parallel.destroy_distributed()


def train_staged(run) -> None:
    """Stages of generate-then-optimise (§4): the engine and the trainer take turns."""
    cfg, policy, rollout, prompts = run.cfg, run.policy, run.rollout, run.prompts
    for stage in range(run.stage, cfg.plan.num_stages):
        t0 = time.perf_counter()
        rollout.sync(policy, stage)  # 1. freeze θ_k as the behaviour policy β_k
        t1 = time.perf_counter()
        dataset = rollout.generate(stage, prompts.for_stage(stage), policy)  # 2. β_k generates D_k
        t2 = time.perf_counter()
        run.optimise(stage, dataset)  # 3. μ updates on the static D_k
        run.log_stage(stage, dataset, t_export=t1 - t0, t_rollout=t2 - t1, t_train=time.perf_counter() - t2)


def train_async(run) -> None:
    """One update at a time on groups streamed from the engine process, which never stops generating (§5.1)."""
    cfg, policy, rollout = run.cfg, run.policy, run.rollout
    rollout.start(policy, run.prompts.train)  # the engine process starts on θ_t and fills the durable queue
    bar = run.progress_bar("optimise (async)")
    for update in range(run.global_update, cfg.plan.total_updates):
        samples, queue = rollout.next_batch(policy.version, cfg.plan.prompts_per_update)  # lag ≤ K; older dropped
        run.train_on(samples, 0, bar, **queue)  # one update with the stored behaviour log-probs
        if (update + 1) % cfg.plan.weight_sync_interval == 0 and update + 1 < cfg.plan.total_updates:
            rollout.sync(policy, update + 1)  # θ to the engine: it finishes its current shard, then reloads
    bar.close()


if __name__ == "__main__":
    main()
