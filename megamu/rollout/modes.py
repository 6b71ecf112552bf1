"""How the engine lives through a run: one class per --rollout-mode, chosen once at start-up.

Every rank calls every method (weights move collectively); the engine itself runs on global rank 0.
- ``StagedRollout`` (μ-GRPO, §4): each stage exports θ_k as an HF folder, starts an engine on it, generates the
  static dataset D_k, and shuts the engine down so its memory is free for the μ updates.
- ``ColocatedRollout`` (the fair standard-GRPO baseline): the engine stays up between refreshes; new weights are
  pushed to it in place: in memory (the in-process engine; SGLang with --weight-sync memory, its default here, no
  per-refresh export) or from an HF folder (SGLang with --weight-sync disk). Each SGLang refresh is checked (layout,
  weight version, a teacher-forced log-prob probe) and logged as a "sync" metrics record.
- ``AsyncRollout`` (§5.1, megamu.rollout.async_mode): an engine process generates while the trainer trains.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from pathlib import Path

from megamu import parallel
from megamu.data.prompts import PromptRecord, stop_token_ids
from megamu.metrics import MetricsLogger
from megamu.reward.config import RewardConfig
from megamu.rollout import Engine, EngineConfig, build_engine
from megamu.rollout.dataset import MANIFEST, StageDataset
from megamu.rollout.phase import generate_groups, run_rollout_phase
from megamu.rollout.types import SamplingParams
from megamu.training.checkpoint import prune_stage_export

ROLLOUT_MODES = ("staged", "colocated", "async")
PROBE_TOKENS = 32  # tokens of the first held-out prompt whose log-probs check each SGLang refresh


@dataclass(frozen=True)
class RolloutConfig:
    mode: str
    engine: EngineConfig
    run_dir: Path  # datasets go to <run_dir>/rollouts/stage_k
    n_samples: int  # G
    seed: int
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 64
    groups_per_shard: int = 16
    shards_per_call: int = 1
    reward: RewardConfig = RewardConfig()  # math-verify unless --reward code or --reward-fn
    # async mode (megamu.rollout.async_mode)
    max_policy_lag: int = 1024  # K: groups generated more than K updates ago are dropped, never trained on
    queue_groups: int = 64  # the engine stays at most this many stored-but-unconsumed groups ahead of the trainer
    worker_threads: int | None = None  # CPU: torch threads of the engine process (None: the device's default)
    rollout_devices: str | None = None  # GPU: CUDA_VISIBLE_DEVICES of the engine process (its SGLang servers)


class Rollout:
    """What both modes share: sampling settings, the reward scorer, the rollout phase and the held-out evaluation."""

    def __init__(self, cfg: RolloutConfig, tokenizer, metrics: MetricsLogger, held_out: list[PromptRecord]):
        self.cfg, self.tokenizer, self.metrics, self.held_out = cfg, tokenizer, metrics, held_out
        self.engine: Engine | None = None  # rank 0 only
        self.scorer = None  # rank 0 only, created with the first engine
        self.hf_dir: Path | None = None  # the folder the next engine starts from
        self.t_eval = 0.0  # seconds of this process's last held-out evaluation (rank 0), for the run's ETA

    # -- what each mode decides
    def sync(self, policy, stage: int) -> None:
        """1. θ_k becomes the behaviour policy β_k: its weights reach (or will start) the engine."""
        raise NotImplementedError

    def _engine(self) -> Engine:
        raise NotImplementedError

    def _release(self) -> None:
        """After a stage's generation: keep the engine for the next refresh, or stop it and free its memory."""
        raise NotImplementedError

    def state(self) -> dict:
        """Rollout progress a checkpoint must carry beyond the stage counters (async mode's queue cursor)."""
        return {}

    def restore(self, state: dict) -> None:
        pass

    # -- shared
    def dataset_dir(self, stage: int) -> Path:
        return self.cfg.run_dir / "rollouts" / f"stage_{stage}"

    def done(self, stage: int) -> bool:
        return (self.dataset_dir(stage) / "manifest.json").exists()

    def sampling(self, stage: int) -> SamplingParams:
        c = self.cfg
        return SamplingParams(temperature=c.temperature, top_p=c.top_p, max_new_tokens=c.max_new_tokens,
                              seed=c.seed + stage, stop_token_ids=stop_token_ids(self.tokenizer))

    def generate(self, stage: int, prompts: list[PromptRecord], policy) -> StageDataset:
        """2. β_k generates D_k = {(x, y, A, b_1:T)} (durable, resumable); every rank then reads it."""
        done = self.done(stage)
        parallel.barrier()  # every rank has looked before rank 0 can write the manifest: all take the same branch
        if not done:
            policy.release_memory()
            if parallel.is_main_rank():
                engine = self._engine()
                run_rollout_phase(engine, prompts, self.dataset_dir(stage), sampling=self.sampling(stage),
                                  n_samples=self.cfg.n_samples, scorer=self._scorer(), tokenizer=self.tokenizer,
                                  stage=stage, policy_version=policy.version,
                                  groups_per_shard=self.cfg.groups_per_shard,
                                  shards_per_call=self.cfg.shards_per_call, model_path=str(self.hf_dir or ""))
                if stage == 0 and self.held_out:
                    self._evaluate(engine, stage=0, label="base")
            self._release()
            # Ranks 1..N wait out rank 0's rollout (hours at the paper's scale) on the CPU, not in an NCCL collective
            # bound by --distributed-timeout-minutes.
            parallel.wait_for_main_rank()
            policy.restore_memory()
            if parallel.is_main_rank() and self.hf_dir is not None and self.hf_dir.name == f"stage_{stage}":
                prune_stage_export(self.hf_dir, self.dataset_dir(stage) / MANIFEST)  # D_k is durable: not needed
            parallel.barrier()
        return StageDataset(self.dataset_dir(stage))

    def evaluate_final(self, hf_dir: Path, stage: int) -> None:
        """Greedy accuracy of the exported final policy on the held-out prompts (rank 0)."""
        if parallel.is_main_rank() and self.held_out:
            if self.engine is not None:
                self.engine.update_weights(hf_dir=str(hf_dir))
            else:
                self.engine = build_engine(self.cfg.engine, hf_dir)
            self._evaluate(self.engine, stage=stage, label="final")

    def close(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None
        if self.scorer is not None:
            self.scorer.close()
            self.scorer = None

    def _scorer(self):
        if self.scorer is None:
            from megamu.reward import make_scorer

            self.scorer = make_scorer(self.cfg.reward)
        return self.scorer

    def _evaluate(self, engine: Engine, *, stage: int, label: str) -> float:
        """Greedy accuracy on the held-out prompts (the demo's before/after number)."""
        greedy = replace(self.sampling(stage), temperature=1.0, top_k=1, seed=0)
        t0 = time.perf_counter()
        groups = generate_groups(engine, self.held_out, greedy, 1, self._scorer(), self.tokenizer, stage=stage)
        self.t_eval = time.perf_counter() - t0
        acc = sum(g[0].reward for g in groups) / max(len(groups), 1)
        self.metrics.log("eval", stage=stage, label=label, accuracy=acc, n=len(groups))
        print(f"[eval] {label}: greedy accuracy {acc:.3f} on {len(groups)} held-out prompts", flush=True)
        return acc


class StagedRollout(Rollout):
    def sync(self, policy, stage: int) -> None:
        if not self.done(stage):
            self.hf_dir = policy.export(f"stage_{stage}")

    def _engine(self) -> Engine:
        self.engine = build_engine(self.cfg.engine, self.hf_dir)
        return self.engine

    def _release(self) -> None:
        if self.engine is None:
            return
        self.engine.shutdown()  # the engine's memory is free for the optimisation phase (§4, Phase 1)
        self.engine = None


class ColocatedRollout(Rollout):
    """The engine is started once from an HF folder, then refreshed in place before each stage."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.warm = False  # known on every rank: whether rank 0's engine is up (set by the collective generate)

    def sync(self, policy, stage: int) -> None:
        if self.done(stage):
            return
        if not self.warm:
            self.hf_dir = policy.export(f"stage_{stage}")  # the first engine starts from a folder
        elif self.cfg.engine.kind == "local":
            weights = policy.engine_weights()  # collective: every TP rank takes part, rank 0 pushes
            if parallel.is_main_rank():
                self.engine.update_weights(state_dict=weights)
        else:
            memory = self.cfg.engine.weight_sync == "memory"
            weights = policy.engine_weights() if memory else None  # collective, like the export
            if not memory:
                self.hf_dir = policy.export(f"stage_{stage}")
            probe = policy.logprob_probe(self.held_out[0].prompt_ids[:PROBE_TOKENS]) if self.held_out else None
            if parallel.is_main_rank():
                report = self.engine.update_weights(hf_dir=None if memory else str(self.hf_dir), state_dict=weights,
                                                    version=policy.version, probe=probe)
                self.metrics.log("sync", step=stage, stage=stage, mode=report.mode, t_sync=report.seconds,
                                 bytes=report.bytes, weight_version=report.version,
                                 probe_mean_abs_diff=report.probe_mean_abs_diff)

    def _engine(self) -> Engine:
        if self.engine is None:
            self.engine = build_engine(self.cfg.engine, self.hf_dir)
        return self.engine

    def _release(self) -> None:
        self.warm = True


def make_rollout(cfg: RolloutConfig, tokenizer, metrics: MetricsLogger, held_out: list[PromptRecord]) -> Rollout:
    from megamu.rollout.async_mode import AsyncRollout

    modes = {"staged": StagedRollout, "colocated": ColocatedRollout, "async": AsyncRollout}
    if cfg.mode not in modes:
        raise ValueError(f"unknown rollout mode {cfg.mode!r}; expected one of {ROLLOUT_MODES}")
    return modes[cfg.mode](cfg, tokenizer, metrics, held_out)
