"""A μ-GRPO run: the parts the loops (staged.py, async_.py) string together, and the run's progress.

``Run`` builds the parts from their configs (megamu.run_config) and keeps what every loop shares: the policy (model,
optimiser, checkpoints, exports), the prompts, the metrics, one optimiser update with its record, checkpoints, the ETA
line and the final summary. What the engine does and when is the loops' business.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from megamu import parallel
from megamu.data.stage_prompts import Prompts
from megamu.faults import crash_point
from megamu.loop.state import RunState
from megamu.metrics import MetricsLogger, read_metrics
from megamu.policy import Policy
from megamu.rollout.dataset import StageDataset
from megamu.run_dir import RunDir
from megamu.tracking import make_tracker
from megamu.weights import Weights

if TYPE_CHECKING:
    from megamu.run_config import RunConfig


class Run:
    def __init__(self, cfg: RunConfig):
        from transformers import AutoTokenizer

        self.cfg, self.plan, self.run_dir = cfg, cfg.plan, RunDir(cfg.save)
        self.eta_shown = False
        self.policy = Policy(cfg.policy)
        self.tokenizer = AutoTokenizer.from_pretrained(self.policy.hf_source)
        self.prompts = Prompts(cfg.prompts, self.tokenizer)
        self.state = RunState()
        saved = self.policy.load_latest()
        if cfg.algo.uses_reference:  # the KL term's π_ref: the run's initial weights (not built at coefficient 0)
            self.policy.build_reference()
        if saved is not None:
            self.state.load_state_dict(saved)
            if self.plan.rollout_mode != "async" and self.state.update >= (self.state.stage + 1) * self.plan.mu:
                self.state.stage += 1  # saved at a stage's end: its rollout and updates are done
            how = "resumed from" if self.policy.resumed else "started from the earlier run in"
            _print(f"{how} {self.policy.loaded_from}: update {self.state.update} of {self.plan.total_updates}"
                   + ("" if self.plan.rollout_mode == "async" else f" (stage {self.state.stage})"))
        elif self.policy.loaded_from != self.policy.hf_source:
            _print(f"a new run from the weights in {self.policy.loaded_from}")
        settings = {**self.plan.summary(), **vars(cfg.algo), **vars(cfg.policy.optimizer)}  # wandb's run config
        tracker = make_tracker(cfg.tracker, cfg.save, settings) if parallel.is_main_rank() else None
        self.metrics = MetricsLogger(str(cfg.save), cfg.tensorboard_dir, enabled=parallel.is_main_rank(),
                                     elapsed_offset=self.state.elapsed, tracker=tracker)
        self.metrics.truncate(stage=self.state.stage, update=self.state.update)

    def train_on(self, samples: list, stage: int, bar, *, log: bool, save: bool, **fields) -> None:
        """One optimiser update; its metrics record (plus ``fields``) if ``log``, a checkpoint if ``save`` (the
        loop's cadence); an HF export every --hf-export-interval updates."""
        cfg = self.cfg
        stats = self.policy.update(samples, cfg.algo)
        self.state.update += 1
        if log:
            self.metrics.log("update", step=self.state.update, stage=stage, update=self.state.update - 1, **stats,
                             **fields)
        bar.update(1)
        bar.set_postfix(loss=f"{stats['loss']:.4f}", reward=f"{stats['reward_mean']:.2f}",
                        ratio=f"{stats['ratio_mean']:.3f}", veto=f"{stats['veto_token_fraction']:.3f}")
        if save:
            self.state.elapsed = self.metrics.elapsed()
            self.policy.save(self.state.update, extra={**self.state.state_dict(), "plan": vars(self.plan)})
        if cfg.hf_export_interval and self.state.update % cfg.hf_export_interval == 0:
            self.policy.export(self.run_dir.iter_export(self.state.update))  # for evaluate.py --run
            if parallel.is_main_rank():  # retention: --keep-hf-exports, by default --keep-checkpoints
                self.run_dir.prune_iter_exports(keep=cfg.keep_hf_exports)
        crash_point("update", self.state.update)

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

    def log_stage(self, stage: int, dataset: StageDataset, **times: float) -> None:
        m = dataset.manifest
        self.metrics.log("stage", step=stage, stage=stage, **times, reward_mean=m.reward_mean,
                         truncation_rate=m.truncation_rate, all_correct_fraction=m.all_correct_fraction,
                         all_wrong_fraction=m.all_wrong_fraction, mean_response_length=m.mean_response_length,
                         **({"servers": m.extra["servers"]} if m.extra.get("servers") else {}),  # per SGLang server
                         **{k: m.extra.get(k, 0) for k in ("reward_errors", "reward_timeouts")},
                         # DAPO's: replies in the overlong buffer; dynamic sampling's rounds and groups
                         **{k: m.extra[k] for k in ("overlong_fraction",) if k in m.extra},
                         **{f"dynamic_sampling_{k}": v for k, v in m.extra.get("dynamic_sampling", {}).items()},
                         **self.policy.memory_record())
        if self.metrics.tracker is not None:  # a few of D_k's generations, decoded (verl's generations table)
            rows = [[stage, s.prompt_id, s.sample_index, self.tokenizer.decode(s.prompt_ids),
                     self.tokenizer.decode(s.response_ids), s.reward, s.advantage]
                    for g in range(min(4, dataset.num_groups)) for s in dataset.group(g)]
            self.metrics.table(f"samples/stage_{stage}", ["stage", "prompt_id", "sample", "prompt", "response",
                                                         "reward", "advantage"], rows)
        _print(f"[stage {stage}] rollout reward {m.reward_mean:.3f}  export {times['t_export']:.1f}s  "
               f"rollout {times['t_rollout']:.1f}s  train {times['t_train']:.1f}s")
        crash_point("stage", stage)

    def finish(self) -> None:
        """Close the metrics with the run's record and print the summary."""
        self.metrics.log("run", t_total=self.metrics.elapsed(), total_updates=self.state.update)
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
            sampled = f", pass@1 {r['pass1']:.3f} (k = {r['k']})" if "pass1" in r else ""
            print(f" {r.get('set', 'held-out')} greedy accuracy ({r['label']}): {r['accuracy']:.3f}{sampled} on "
                  f"{r['n']} prompts")
        for r in [r for r in rows if r["kind"] == "run"][-1:]:
            print(f" total {r['t_total']:.1f}s, {r['total_updates']} updates; metrics in {self.metrics.path}")


def _print(msg: str) -> None:
    if parallel.is_main_rank():
        print(msg, flush=True)
