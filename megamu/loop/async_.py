"""``--rollout-mode async`` (paper §5.1, Table 2): rollout and training at the same time.

An engine process (megamu.loop.async_worker, driven through megamu.loop.engine_process) generates continuously into
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

from megamu.data.prompts import stop_token_ids
from megamu.engines import build_engine
from megamu.loop.engine_process import EngineProcess
from megamu.loop.heldout import evaluate_sets
from megamu.loop.state import QueueCursor
from megamu.runtime import parallel

if TYPE_CHECKING:
    from megamu.loop.trainer import Trainer


def train_async(trainer: Trainer) -> None:
    """One update at a time on groups streamed from the engine process, which never stops generating (§5.1)."""
    cfg, plan, policy, run_dir = trainer.cfg, trainer.plan, trainer.policy, trainer.run_dir
    trainer.state.queue = trainer.state.queue or QueueCursor()
    engine = EngineProcess(cfg.async_, cfg.rollout, cfg.engine, run_dir, trainer.tokenizer, trainer.metrics,
                           max_policy_lag=plan.max_policy_lag, queue=trainer.state.queue, mode=trainer.mode)
    if parallel.is_main_rank():  # sync folders past this checkpoint came from a lost timeline
        trainer.mode.prune_before_start(run_dir)
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
    final = trainer.export_final()  # collective: before rank 0 alone stops the engine process
    engine.stop()  # the engine process's memory is free for the evaluation's engine
    if parallel.is_main_rank() and trainer.prompts.eval_sets:
        from megamu.reward import make_scorer

        evaluator, scorer = build_engine(cfg.engine, final.hf_dir), make_scorer(cfg.rollout.reward)
        try:
            # "stage" 1: after the run's one stream, as a staged run's final evaluation follows its last stage
            sampling = cfg.rollout.sampling(1, stop_token_ids(trainer.tokenizer))
            evaluate_sets(evaluator, trainer.prompts.eval_sets, sampling, cfg.evaluation, scorer, trainer.tokenizer,
                          trainer.metrics, stage=1, update=trainer.state.update, label="final")
        finally:
            evaluator.shutdown()
            scorer.close()
