"""A μ-GRPO run: the parts that pretrain_mu_grpo.py's stage loop strings together (DESIGN.md, paper §4).

``Run`` builds the parts from their configs (megamu.arguments) and keeps the run's progress: the policy (model,
optimiser, checkpoints, exports), the rollout (engine lifecycle, one class per mode), the prompts, and the metrics.
"""

from __future__ import annotations

import time
from dataclasses import replace

from megamu import parallel
from megamu.data.stage_prompts import Prompts
from megamu.faults import crash_point
from megamu.metrics import MetricsLogger, read_metrics
from megamu.policy import Policy
from megamu.rollout.dataset import StageDataset
from megamu.rollout.modes import make_rollout
from megamu.run_config import RunConfig


class Run:
    def __init__(self, cfg: RunConfig):
        from transformers import AutoTokenizer

        self.cfg, self.plan = cfg, cfg.plan
        self.eta_shown = False
        self.policy = Policy(cfg.policy)
        tokenizer = AutoTokenizer.from_pretrained(self.policy.hf_source)
        self.prompts = Prompts(cfg.prompts, tokenizer)
        extra = self.policy.restore()
        self.stage, self.update_in_stage, elapsed = (0, 0, 0.0) if extra is None else (
            extra["stage"], extra["update_in_stage"], extra["elapsed"])
        if self.update_in_stage >= self.plan.mu:
            self.stage, self.update_in_stage = self.stage + 1, 0
        if extra is not None:
            _print(f"resumed from {cfg.policy.load_dir}: stage {self.stage}, update {self.update_in_stage} of "
                   f"{self.plan.mu}")
        self.metrics = MetricsLogger(str(cfg.save), cfg.tensorboard_dir, enabled=parallel.is_main_rank(),
                                     elapsed_offset=elapsed)
        self.metrics.truncate(stage=self.stage, update=self.global_update)
        self.rollout = make_rollout(cfg.rollout, tokenizer, self.metrics, self.prompts.held_out)
        if extra is not None and extra.get("rollout"):
            self.rollout.restore(extra["rollout"])

    @property
    def global_update(self) -> int:
        return self.stage * self.plan.mu + self.update_in_stage

    def optimise(self, stage: int, dataset: StageDataset) -> None:
        """μ updates on the static dataset D_k; checkpoints every --save-interval updates and at the stage end."""
        cfg, mu = self.cfg, self.plan.mu
        batches = dataset.minibatches(self.plan.prompts_per_update, seed=cfg.seed + stage,
                                      start_update=self.update_in_stage, num_updates=mu)
        anchors = self.policy.behaviour_anchors(dataset.samples(), dataset.dir / "recomputed_logprobs.pt") \
            if cfg.recompute_behaviour_logprobs else None
        bar = self.progress_bar(f"optimise stage {stage}")
        for samples in batches:
            if anchors is not None:
                samples = [replace(s, behaviour_logprobs=anchors[(s.prompt_id, s.sample_index)]) for s in samples]
            t0 = time.perf_counter()
            self.train_on(samples, stage, bar)
            if not self.eta_shown:
                self.show_eta(stage, dataset, time.perf_counter() - t0, bar)
        bar.close()
        self.stage, self.update_in_stage = stage + 1, 0

    def train_on(self, samples: list, stage: int, bar, **fields) -> None:
        """One optimiser update; its metrics record (plus ``fields``), checkpoints and exports at their intervals."""
        cfg, mu = self.cfg, self.plan.mu
        stats = self.policy.update(samples, cfg.algo)
        self.update_in_stage += 1
        if self.update_in_stage % cfg.log_interval == 0 or self.update_in_stage == mu:
            self.metrics.log("update", step=self.global_update, stage=stage, update=self.global_update - 1, **stats,
                             **fields)
        bar.update(1)
        bar.set_postfix(loss=f"{stats['loss']:.4f}", reward=f"{stats['reward_mean']:.2f}",
                        ratio=f"{stats['ratio_mean']:.3f}", veto=f"{stats['veto_token_fraction']:.3f}")
        if self.checkpoint_due():
            self.checkpoint(stage)
        if cfg.hf_export_interval and self.global_update % cfg.hf_export_interval == 0:
            self.policy.export(f"iter_{self.global_update:07d}")  # for evaluate.py --run
        crash_point("update", self.global_update)

    def show_eta(self, stage: int, dataset: StageDataset, t_update: float, bar) -> None:
        """After this process's first update: the rest of the run, from this stage's rollout and that update."""
        self.eta_shown = True
        stages_left = self.plan.num_stages - stage - 1
        updates_left = self.plan.total_updates - self.global_update
        t_rollout, t_eval = dataset.manifest.t_rollout_s, self.rollout.t_eval
        eta = updates_left * t_update + stages_left * t_rollout + t_eval
        if parallel.is_main_rank():
            bar.write(f"[eta] about {eta / 60:.1f} min more for the run on this machine: {updates_left} updates at "
                      f"~{t_update:.1f}s, {stages_left} more rollout(s) at ~{t_rollout:.0f}s (this stage's)"
                      + (f", a final evaluation at ~{t_eval:.0f}s" if t_eval else ""))

    def checkpoint_due(self) -> bool:
        """Staged and async mode: every --save-interval updates of a stage and at each stage's end (a resume then
        skips the stage). Colocated mode refreshes every μ (= 4) updates: every --save-interval updates of the run
        and at its end, not at each refresh (1024 checkpoints in the paper's GRPO baseline)."""
        cfg, mu = self.cfg, self.plan.mu
        if self.plan.rollout_mode == "colocated":
            last = self.global_update == self.plan.total_updates
            return last or bool(cfg.save_interval and self.global_update % cfg.save_interval == 0)
        return self.update_in_stage == mu or bool(cfg.save_interval and self.update_in_stage % cfg.save_interval == 0)

    def progress_bar(self, desc: str):
        from tqdm import tqdm

        return tqdm(total=self.plan.mu, initial=self.update_in_stage, desc=desc, unit="update",
                    disable=not parallel.is_main_rank(), dynamic_ncols=True)

    def checkpoint(self, stage: int) -> None:
        self.policy.save(self.global_update, extra={"stage": stage, "update_in_stage": self.update_in_stage,
                                                    "elapsed": self.metrics.elapsed(), "plan": vars(self.plan),
                                                    "rollout": self.rollout.state()})

    def log_stage(self, stage: int, dataset: StageDataset, **times: float) -> None:
        m = dataset.manifest
        self.metrics.log("stage", step=stage, stage=stage, **times, reward_mean=m.reward_mean,
                         truncation_rate=m.truncation_rate, all_correct_fraction=m.all_correct_fraction,
                         all_wrong_fraction=m.all_wrong_fraction, mean_response_length=m.mean_response_length,
                         **self.policy.memory_record())
        _print(f"[stage {stage}] rollout reward {m.reward_mean:.3f}  export {times['t_export']:.1f}s  "
               f"rollout {times['t_rollout']:.1f}s  train {times['t_train']:.1f}s")
        crash_point("stage", stage)

    def finish(self) -> None:
        """Export the final policy, measure its held-out greedy accuracy, stop the engine and close the metrics."""
        final = self.policy.export("final")
        self.rollout.evaluate_final(final, stage=self.plan.num_stages)
        self.rollout.close()
        self.metrics.log("run", t_total=self.metrics.elapsed(), total_updates=self.global_update)
        self.metrics.close()
        self.summary()

    def summary(self) -> None:
        """The final table: per-stage rollout reward and timings, then the held-out evaluation."""
        if not parallel.is_main_rank():
            return
        rows = read_metrics(self.cfg.save)
        print("\n stage | rollout reward | all-correct | all-wrong | trunc. | t_export | t_rollout | t_train")
        for r in (r for r in rows if r["kind"] == "stage"):
            print(f" {r['stage']:>5} | {r['reward_mean']:>14.3f} | {r['all_correct_fraction']:>11.2f} | "
                  f"{r['all_wrong_fraction']:>9.2f} | {r['truncation_rate']:>6.2f} | {r['t_export']:>7.1f}s |"
                  f" {r['t_rollout']:>8.1f}s | {r['t_train']:>6.1f}s")
        last = [r for r in rows if r["kind"] == "update" and "idle_ratio" in r][-1:]
        for r in last:  # async mode
            print(f" async: trainer idle ratio {r['idle_ratio']:.3f}, {r['dropped_stale']} stale samples dropped, "
                  f"{sum(x['kind'] == 'sync' for x in rows)} weight syncs")
        for r in (r for r in rows if r["kind"] == "eval"):
            print(f" held-out greedy accuracy ({r['label']}): {r['accuracy']:.3f} on {r['n']} prompts")
        for r in [r for r in rows if r["kind"] == "run"][-1:]:
            print(f" total {r['t_total']:.1f}s, {r['total_updates']} updates; metrics in {self.metrics.path}")


def _print(msg: str) -> None:
    if parallel.is_main_rank():
        print(msg, flush=True)
