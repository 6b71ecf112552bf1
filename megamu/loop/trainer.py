"""The Trainer: the owner of a μ-GRPO run (torchtitan's Trainer as the model: ``trainer = Trainer(cfg)``, then
``try: trainer.train() finally: trainer.close()``, as torchtitan/train.py's main does).

It starts the process groups, builds the run's parts from their configs (megamu.config.run_config) and owns them:
the plan (which holds the run's mode), the policy (model, optimiser, checkpoints, exports), the prompts, the metrics
and the run's progress (the async queue's cursor included). ``train`` runs the mode's loop (megamu.loop.staged or
megamu.loop.async_, which drive the engine) and the summary; ``close`` stops the process groups. It owns what every
loop shares: one optimiser update with its record, the checkpoint cadence (the plan's), HF export retention (the
mode's), the stage counter (moved only by ``_stage_over``), evaluation on an engine holding θ and the run's one final
evaluation, the ETA line and the final summary. What a checkpoint
carries besides the policy's weights and optimiser is the Trainer's ``state_dict`` (torch.distributed.checkpoint's
``Stateful``): the progress (``RunState``, Stateful too) and the plan. What the engine does and when is the loops'
business.
"""

from __future__ import annotations

import math
import os
from typing import TYPE_CHECKING

import torch

from megamu.data.prompts import stop_token_ids
from megamu.data.stage_prompts import Prompts
from megamu.engines.weights import Weights
from megamu.evaluation.heldout import evaluate_sets
from megamu.loop.state import QueueCursor, RunState
from megamu.loop.summary import print_summary
from megamu.observability.drift import StageDrift
from megamu.observability.metrics import MetricsLogger
from megamu.observability.tracking import make_tracker
from megamu.rollout.dataset import StageDataset
from megamu.run.run_dir import RunDir
from megamu.runtime import parallel
from megamu.runtime.faults import crash_point
from megamu.training.policy import Policy

if TYPE_CHECKING:
    from megamu.config.plan import Plan
    from megamu.config.run_config import RunConfig
    from megamu.engines import Engine
    from megamu.engines.types import SamplingParams


class Trainer:
    def __init__(self, cfg: RunConfig):
        from transformers import AutoTokenizer

        _start_distributed(cfg)
        self.cfg: RunConfig = cfg
        self.plan: Plan = cfg.plan
        self.run_dir = RunDir(cfg.save)
        self.eta_shown = False
        self.policy = Policy(cfg.policy)
        self.tokenizer = AutoTokenizer.from_pretrained(self.policy.hf_source)
        self.prompts = Prompts(cfg.prompts, self.tokenizer)
        self.state = RunState()
        self._trained = False  # train() returned: close() may stop the process groups
        self._stage_stats: list[tuple[float, float]] = []  # this stage's (approx_kl, veto_token_fraction) per update
        saved = self.policy.load_latest()
        if cfg.algo.uses_reference:  # the KL term's π_ref: the run's initial weights (not built at coefficient 0)
            self.policy.build_reference()
        if saved is not None:
            self.load_state_dict(saved)
            how = "resumed from" if self.policy.resumed else "started from the earlier run in"
            _print(f"{how} {self.policy.loaded_from}: update {self.state.update} of {self.plan.total_updates}"
                   + self.plan.where(self.state.stage))
        elif self.policy.loaded_from != self.policy.hf_source:
            _print(f"a new run from the weights in {self.policy.loaded_from}")
        if self.plan.mode.streams and self.state.queue is None:  # async: the queue's cursor starts at its first group
            self.state.queue = QueueCursor()
        settings = {**self.plan.summary(), **vars(cfg.algo), **vars(cfg.policy.optimizer)}  # wandb's run config
        tracker = make_tracker(cfg.tracker, cfg.save, settings) if parallel.is_main_rank() else None
        self.metrics = MetricsLogger(str(cfg.save), cfg.tensorboard_dir, enabled=parallel.is_main_rank(),
                                     elapsed_offset=self.state.elapsed, tracker=tracker)
        self.metrics.truncate(stage=self.state.stage, update=self.state.update)

    # -- the run
    def train(self) -> None:
        """The mode's loop, to the run's last update and its final evaluation, then the run's record and summary."""
        from megamu.loop.async_ import train_async
        from megamu.loop.staged import train_staged

        if self.plan.mode.streams:  # §5.1: an engine process streams groups while the trainer trains
            train_async(self)
        else:  # §4, every stage k: publish θ_k, offload, generate D_k, onload, prune, μ updates on D_k
            train_staged(self)
        self.finish()
        self._trained = True

    def close(self) -> None:
        """Stop the process groups ``__init__`` started, after a run that ended. After an error they are left to the
        launcher, as torchtitan/train.py's main destroys its process group only when training returned: a destroy
        behind a collective that failed on another rank may hang."""
        if self._trained:
            parallel.destroy_distributed()

    # -- Stateful: what a checkpoint carries besides the policy's weights and optimiser (flat, as checkpoints
    # written before the Trainer have it: RunState's keys beside "plan")
    def state_dict(self) -> dict:
        return {**self.state.state_dict(), "plan": vars(self.plan)}

    def load_state_dict(self, state_dict: dict) -> None:
        self.state.load_state_dict(state_dict)
        if self.plan.stage_complete(self.state.stage, self.state.update):
            self._stage_over(self.state.stage)  # saved at a stage's end: its rollout and updates are done

    def _stage_over(self, stage: int) -> None:
        """Stage ``stage``'s μ updates are done: the run is at the next stage (the only write of the counter)."""
        self.state.stage = stage + 1

    # -- the run's steps
    def train_on(self, samples: list, bar, **fields) -> None:
        """One optimiser update; its metrics record (plus ``fields``) every --log-interval updates and at each
        stage's (or the run's) end, a checkpoint when the plan's cadence says, an HF export every
        --hf-export-interval updates."""
        cfg, plan, update = self.cfg, self.plan, self.state.update + 1
        stats = self.policy.update(samples, cfg.algo)
        self.state.update = update
        if plan.mode.has_stages:
            self._stage_stats.append((stats["approx_kl"], stats["veto_token_fraction"]))
        if plan.log_due(update, cfg.log_interval):
            self.metrics.log("update", step=update, stage=self.state.stage, update=update - 1, **stats, **fields)
        bar.update(1)
        bar.set_postfix_str(update_postfix(stats))
        if plan.checkpoint_due(update, cfg.save_interval):
            self.state.elapsed = self.metrics.elapsed()
            self.policy.save(update, extra=self.state_dict())
        if cfg.hf_export_interval and update % cfg.hf_export_interval == 0:
            self.policy.export(self.run_dir.iter_export(update))  # for evaluate.py --run
            if parallel.is_main_rank():
                plan.mode.prune_iter_exports(self.run_dir, keep=cfg.keep_hf_exports)
        crash_point("update", update)

    def stage_done(self, stage: int, dataset: StageDataset, **times: float) -> None:
        """Stage ``stage``'s μ updates are done: the counter moves on and the stage's record is logged."""
        self._stage_over(stage)
        self._log_stage(stage, dataset, **times)

    def show_eta(self, stage: int, t_update: float, t_rollout: float, t_eval: float) -> None:
        """After this process's first update: the rest of the run, from this stage's rollout and that update."""
        self.eta_shown = True
        stages_left = self.plan.num_stages - stage - 1
        updates_left = self.plan.total_updates - self.state.update
        eta = updates_left * t_update + stages_left * t_rollout + t_eval
        _print(f"[eta] about {eta / 60:.1f} min more for the run on this machine: {updates_left} updates at "
               f"~{t_update:.1f}s, {stages_left} more rollout(s) at ~{t_rollout:.0f}s (this stage's)"
               + (f", a final evaluation at ~{t_eval:.0f}s" if t_eval else ""))

    def progress_bar(self, desc: str, total: int, initial: int):
        from tqdm import tqdm

        return tqdm(total=total, initial=initial, desc=desc, unit="update", disable=not parallel.is_main_rank(),
                    dynamic_ncols=True)

    def export_final(self) -> Weights:
        """The final policy as an HF folder (hf/final), for its held-out evaluation and for the user."""
        return self.policy.weights(hf_dir=self.run_dir.final_export)

    # -- evaluation (rank 0 scores; megamu.evaluation.heldout)
    def sampling(self, stage: int) -> SamplingParams:
        """The rollout's sampling parameters for ``stage`` (its seed), stopping at the tokenizer's end tokens."""
        return self.cfg.rollout.sampling(stage, stop_token_ids(self.tokenizer))

    def evaluate(self, engine, scorer, stage: int, label: str, weights: Weights | None = None) -> float | None:
        """The evaluation sets scored (rank 0) on the engine ``engine.eval_engine(weights)`` gives: the one holding
        θ, or one holding ``weights`` (an HF folder); the seconds it took, for the run's ETA (None: nothing evaluated
        here)."""
        if not (parallel.is_main_rank() and self.prompts.eval_sets):
            return None
        evaluator: Engine = engine.eval_engine(weights)
        return evaluate_sets(evaluator, self.prompts.eval_sets, self.sampling(stage), self.cfg.evaluation, scorer,
                             self.tokenizer, self.metrics, stage=stage, update=self.state.update, label=label)

    def final_evaluation(self, engine, scorer, stage: int) -> None:
        """Every mode's last step: the final policy exported (collective, while every rank holds its weights), then
        held-out on the engine the mode's ``engine`` gives for it (a kept-up engine takes the weights back, a
        restarted one starts on them, the async engine process stops and one engine starts on them: the servers
        take their memory back, or start, only once the trainer has given the device back), as stage ``stage``."""
        final = self.export_final()
        self.policy.offload()
        self.evaluate(engine, scorer, stage, "final", final)
        self.policy.onload()  # the spilled optimiser state comes back (and its spill files go) before the run's end

    def _log_stage(self, stage: int, dataset: StageDataset, **times: float) -> None:
        m = dataset.manifest
        drift = StageDrift.of(*zip(*self._stage_stats)) if self._stage_stats else None
        self._stage_stats = []
        self.metrics.log("stage", step=stage, stage=stage, **times, reward_mean=m.reward_mean,
                         truncation_rate=m.truncation_rate, all_correct_fraction=m.all_correct_fraction,
                         all_wrong_fraction=m.all_wrong_fraction, mean_response_length=m.mean_response_length,
                         **({"servers": m.extra["servers"]} if m.extra.get("servers") else {}),  # per SGLang server
                         **{k: m.extra.get(k, 0) for k in ("reward_errors", "reward_timeouts")},
                         # DAPO's: replies in the overlong buffer; dynamic sampling's rounds and groups
                         **{k: m.extra[k] for k in ("overlong_fraction",) if k in m.extra},
                         **{f"dynamic_sampling_{k}": v for k, v in m.extra.get("dynamic_sampling", {}).items()},
                         **(drift.record() if drift else {}), **self.policy.memory_record())
        if self.metrics.tracker is not None:  # a few of D_k's generations, decoded (verl's generations table)
            rows = [[stage, s.prompt_id, s.sample_index, self.tokenizer.decode(s.prompt_ids),
                     self.tokenizer.decode(s.response_ids), s.reward, s.advantage]
                    for g in range(min(4, dataset.num_groups)) for s in dataset.group(g)]
            self.metrics.table(f"samples/stage_{stage}", ["stage", "prompt_id", "sample", "prompt", "response",
                                                         "reward", "advantage"], rows)
        _print(f"[stage {stage}] rollout reward {m.reward_mean:.3f}  export {times['t_export']:.1f}s  "
               f"rollout {times['t_rollout']:.1f}s  train {times['t_train']:.1f}s"
               + (f"  {drift.line()}" if drift else ""))
        hint = drift.hint(stage) if drift else None
        if hint:
            _print(hint)
        crash_point("stage", stage)

    def finish(self) -> None:
        """Close the metrics with the run's record and print the summary (rank 0)."""
        self.metrics.log("run", t_total=self.metrics.elapsed(), total_updates=self.state.update)
        self.metrics.close()
        if parallel.is_main_rank():
            print_summary(self.cfg.save, self.metrics.path)


def _start_distributed(cfg: RunConfig) -> None:
    """The process groups (megamu.runtime.parallel), after the CPU thread settings."""
    if cfg.cpu_threads:
        torch.set_num_threads(cfg.cpu_threads)  # CPU async: the engine process has the other cores
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        torch.set_num_threads(1)  # torchrun ranks share the cores; spinning OpenMP workers slow everyone down
    parallel.init_distributed(cfg.tensor_model_parallel_size, cfg.seed, cfg.device,
                              distributed_timeout_minutes=cfg.distributed_timeout_minutes,
                              expert_model_parallel_size=cfg.expert_model_parallel_size,
                              expert_tensor_parallel_size=cfg.expert_tensor_parallel_size)


def _print(msg: str) -> None:
    if parallel.is_main_rank():
        print(msg, flush=True)


def update_postfix(stats: dict[str, float]) -> str:
    """The progress bar's fields of one update. An update whose groups all have zero advantage has nothing to learn
    from: with --skip-zero-advantage no token is scored, so its ratio and veto fraction are undefined (NaN in the
    record); the bar says so instead of printing nan."""
    def shown(value: float, spec: str) -> str:
        return "–" if math.isnan(value) else format(value, spec)

    fields = (f"loss={stats['loss']:.4f}, reward={stats['reward_mean']:.2f}, "
              f"ratio={shown(stats['ratio_mean'], '.3f')}, veto={shown(stats['veto_token_fraction'], '.3f')}")
    if stats["advantage_min"] == 0.0 == stats["advantage_max"]:
        fields += ": nothing to learn (every group's rewards equal)"
    return fields
