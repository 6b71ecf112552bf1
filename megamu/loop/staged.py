"""The staged loop (μ-GRPO, paper §4) and its colocated variant (the fair standard-GRPO baseline).

Each stage k: θ_k is published to the engine as β_k, the trainer offloads, rank 0's engine generates the static
dataset D_k, the trainer onloads, the stage's HF export is pruned, and μ updates run on D_k. How the engine lives
across stages (restarted each stage, or kept up and refreshed in place) is its lifecycle's business
(megamu.engines.lifecycle), chosen once by the plan's mode (megamu.mode) for the engine's config: this loop has no
mode branch and reads none of the lifecycle's fields. Checkpoints, export retention and the stage counter are the
Trainer's (megamu.loop.trainer), as its plan says, and so are the evaluations, on the lifecycle's engine.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import TYPE_CHECKING

from megamu.algo.dapo import OverlongShaping
from megamu.engines.lifecycle import EngineLifecycle
from megamu.reward import make_scorer
from megamu.rollout.dataset import StageDataset
from megamu.rollout.dynamic import run_dynamic_rollout
from megamu.rollout.phase import run_rollout_phase
from megamu.runtime import parallel

if TYPE_CHECKING:
    from megamu.loop.trainer_view import TrainerView

PROBE_TOKENS = 32  # tokens whose teacher-forced log-probs check each SGLang push (``probe_tokens``)
PROBE_PROMPTS = 4


def probe_tokens(held_out: list, train: list) -> list[int] | None:
    """The tokens of each push's log-prob probe: the first held-out prompt's; without a held-out set (the examples
    pass --eval-prompts 0) the first ``PROBE_PROMPTS`` training prompts' in turn, a fixed choice, so every push is
    still compared with the trainer's log-probs, not only with SGLang's weight-version counter."""
    if held_out:
        return list(held_out[0].prompt_ids[:PROBE_TOKENS])
    ids: list[int] = []
    for p in train[:PROBE_PROMPTS]:
        ids += list(p.prompt_ids[: PROBE_TOKENS // PROBE_PROMPTS])
    return ids if len(ids) > 1 else None


def train_staged(trainer: TrainerView) -> None:
    """Stages of generate-then-optimise (§4): the engine and the trainer take turns, every step visible here."""
    cfg, plan, policy, run_dir = trainer.cfg, trainer.plan, trainer.policy, trainer.run_dir
    mode = plan.mode
    probe_ids = probe_tokens(trainer.prompts.held_out, trainer.prompts.train)
    engine = mode.lifecycle(cfg.engine, trainer.metrics.log, probe_ids=probe_ids)  # how it lives across stages
    if parallel.is_main_rank():  # no engine is up yet: what a killed run kept for one goes now
        mode.prune_before_start(run_dir)
    scorer, t_eval = make_scorer(cfg.rollout.reward) if parallel.is_main_rank() else None, 0.0
    for stage in range(trainer.state.stage, plan.num_stages):
        done = run_dir.stage_done(stage)
        parallel.wait_for_main_rank()  # every rank has looked before rank 0 can write D_k: all take the same branch
        # (on the CPU group: before stage 0, rank 0 alone prunes a killed run's exports and starts the reward pool)
        t0 = t1 = time.perf_counter()
        if not done:
            publish(policy, engine, stage, run_dir.stage_export(stage))  # 1-2. θ_k -> β_k, the trainer offloaded
            t1 = time.perf_counter()
            engine.start(stage)  # 3. β_k up (every rank: SGLang servers may start on every node)
            if parallel.is_main_rank():  # rank 0 writes D_k
                rollout(trainer, engine, scorer, stage)
            if stage == 0 or cfg.evaluation.due(trainer.state.update):  # on the engine that holds θ_k (--eval-interval)
                label = "base" if stage == 0 else f"update {trainer.state.update}"
                t_eval = trainer.evaluate(engine, scorer, stage, label) or t_eval
            engine.offload()  # 4. staged: the engine exits; colocated: its servers release their memory
            parallel.wait_for_main_rank()  # ranks 1..N wait out the rollout on the CPU, not in an NCCL collective
            policy.onload()  # 5. the trainer's state comes back, bit for bit
            if parallel.is_main_rank():  # 6. D_k is durable: hf/stage_k goes (not one servers launched from)
                mode.prune_after_rollout(run_dir, stage, engine_keeps_it=engine.keeps_export(stage))
            parallel.wait_for_main_rank()
        t2 = time.perf_counter()
        dataset = StageDataset(run_dir.stage_rollouts(stage))
        optimise(trainer, stage, dataset, t_eval)  # 7. μ updates on the static D_k
        trainer.stage_done(stage, dataset, t_export=t1 - t0, t_rollout=t2 - t1, t_train=time.perf_counter() - t2)
    trainer.final_evaluation(engine, scorer, plan.num_stages)  # the lifecycle's engine takes θ (or starts on it)
    engine.stop()
    if parallel.is_main_rank():
        mode.prune_at_end(run_dir)
    if scorer is not None:
        scorer.close()


def rollout(trainer: TrainerView, engine: EngineLifecycle, scorer, stage: int) -> None:
    """D_k: the stage's prompts generated and scored, with DAPO's overlong shaping and dynamic sampling if on."""
    cfg, algo = trainer.cfg, trainer.cfg.algo
    overlong = OverlongShaping(cfg.rollout.max_new_tokens, algo.overlong_buffer, algo.overlong_penalty_factor) \
        if algo.overlong_buffer else None  # None or 0: off
    kwargs = dict(sampling=trainer.sampling(stage), n_samples=cfg.rollout.n_samples, scorer=scorer,
                  tokenizer=trainer.tokenizer, stage=stage, policy_version=trainer.policy.version,
                  groups_per_shard=cfg.rollout.groups_per_shard, shards_per_call=cfg.rollout.shards_per_call,
                  model_path=str(engine.served_folder() or ""), overlong=overlong)
    out = trainer.run_dir.stage_rollouts(stage)
    if algo.dynamic_sampling:
        per_round = algo.sampling_round_prompts
        run_dynamic_rollout(engine.serving(), lambda r: trainer.prompts.for_sampling_round(stage, r, per_round), out,
                            max_rounds=algo.max_sampling_rounds, target=cfg.plan.prompts_per_stage,
                            metric=algo.filter_metric, fill=algo.fill_short_stage, **kwargs)
    else:
        run_rollout_phase(engine.serving(), trainer.prompts.for_stage(stage), out, **kwargs)


def publish(policy, engine: EngineLifecycle, stage: int, export_dir) -> None:
    """θ_k -> β_k (collective), then the device is the engine's: the weights are gathered (or exported) while the
    trainer holds them, the trainer's memory goes back before the servers' weights come back for the push, and the
    pushed tensors' blocks go back to the driver before the servers' KV cache does. slime orders its colocated
    refresh the same way (train.py: offload_train, then onload_weights, update_weights, onload_kv)."""
    want = engine.wants()
    weights = policy.weights(hf_dir=export_dir if want.folder else None, tensors=want.tensors,
                             every_node=want.every_node, probe_ids=want.probe_ids)
    policy.offload()  # the trainer gives the device back (§4)
    engine.update_weights(weights, stage)  # colocated: the servers' weights come back for the push
    del weights  # the pushed tensors, before the rollout needs their memory
    policy.offload()  # again: now it only empties the allocator's cache of the pushed tensors' blocks
    engine.onload()  # colocated: the servers' KV cache comes back


def optimise(trainer: TrainerView, stage: int, dataset: StageDataset, t_eval: float) -> None:
    """μ updates on the static dataset D_k, resuming at the checkpoint's update; an ETA line after the first."""
    cfg, plan, state = trainer.cfg, trainer.plan, trainer.state
    start = state.update - stage * plan.mu
    batches = dataset.minibatches(plan.prompts_per_update, seed=cfg.seed + stage, start_update=start,
                                  num_updates=plan.mu)
    anchors = trainer.policy.behaviour_anchors(dataset.samples(), dataset.dir / "recomputed_logprobs.pt") \
        if cfg.recompute_behaviour_logprobs else None
    bar = trainer.progress_bar(f"optimise stage {stage}", total=plan.mu, initial=start)
    for samples in batches:
        if anchors is not None:
            samples = [replace(s, behaviour_logprobs=anchors[(s.prompt_id, s.sample_index)]) for s in samples]
        t0 = time.perf_counter()
        trainer.train_on(samples, bar)  # logged and checkpointed as the Trainer's cadence says
        if not trainer.eta_shown:
            trainer.show_eta(stage, time.perf_counter() - t0, dataset.manifest.t_rollout_s, t_eval)
    bar.close()
