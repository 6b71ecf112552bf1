"""``--rollout-mode async`` (paper §5.1, Table 2): rollout and training at the same time.

An engine process (megamu.rollout.async_worker, driven through megamu.loop.engine_process) generates continuously into
a durable queue of Parquet shards; the trainer takes ``--prompts-per-update`` groups per update in queue order,
dropping (and counting) every group whose policy lag, trainer version − the version that generated it, exceeds
``--max-policy-lag``; every ``--weight-sync-interval`` updates it exports θ as an HF folder and points the engine at
it. In-flight requests at a sync finish on the old weights and keep their version (the engine reloads between
shards).

Resume: the queue cursor (groups consumed, trained or dropped), the drop count and the idle/busy times travel in the
checkpoint (``RunState.queue``), so a resumed run continues at the first group the checkpointed weights never
consumed; groups the engine stored after that stay in the queue and are consumed, none twice. Which weights generated
which group depends on the engine's timing, so an async run is not bitwise reproducible (a staged run is).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from megamu.loop.engine_process import EngineProcess
from megamu.reward import make_scorer
from megamu.runtime import parallel

if TYPE_CHECKING:
    from megamu.loop.trainer_view import TrainerView


def train_async(trainer: TrainerView) -> None:
    """One update at a time on groups streamed from the engine process, which never stops generating (§5.1)."""
    cfg, plan, policy, run_dir = trainer.cfg, trainer.plan, trainer.policy, trainer.run_dir
    engine = EngineProcess(cfg.async_, cfg.rollout, cfg.engine, run_dir, trainer.tokenizer, trainer.metrics,
                           max_policy_lag=plan.max_policy_lag, queue=trainer.state.queue, mode=plan.mode)
    if parallel.is_main_rank():  # sync folders past this checkpoint came from a lost timeline
        plan.mode.prune_before_start(run_dir)
    parallel.wait_for_main_rank()
    engine.start(policy.weights(hf_dir=run_dir.sync_export(policy.version)), trainer.prompts.train)  # θ_t, collective
    bar = trainer.progress_bar("optimise (async)", total=plan.total_updates, initial=trainer.state.update)
    for update in range(trainer.state.update, plan.total_updates):
        samples, fields = engine.next_batch(policy.version, plan.prompts_per_update)  # lag ≤ K; older dropped
        done = update + 1
        trainer.train_on(samples, bar, **fields)  # logged and checkpointed as the Trainer's cadence says
        if done % plan.weight_sync_interval == 0 and done < plan.total_updates:
            t0 = time.monotonic()  # θ to the engine: it finishes its current shard, then reloads
            engine.publish(policy.weights(hf_dir=run_dir.sync_export(policy.version)), done, t0)
    bar.close()
    # the final evaluation's engine: the engine process stops (rank 0) and one engine starts on the final weights
    scorer = make_scorer(cfg.rollout.reward) if parallel.is_main_rank() and trainer.prompts.eval_sets else None
    try:
        # "stage" 1: after the run's one stream, as a staged run's final evaluation follows its last stage
        trainer.final_evaluation(engine, scorer, 1)
    finally:
        engine.stop()  # the engine process, or the evaluation's engine that followed it
        if scorer is not None:
            scorer.close()
