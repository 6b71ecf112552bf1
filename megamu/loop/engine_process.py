"""The async mode's engine process (paper §5.1), the trainer's side: start it on θ, take batches from its durable
queue in order (groups past the policy lag K dropped and counted), point it at new weights, stop it, and give the final
evaluation an engine on the final weights.

It is the async mode's counterpart of the staged modes' lifecycles (megamu.engines.lifecycle). The process itself
(what generates into the queue, and the queue's layout) is megamu.rollout.async_worker, beside the stage rollout it
mirrors; the loop that drives it, megamu.loop.async_. This side stays in megamu.loop: it moves the run state's queue
cursor (megamu.loop.state), reads the mode, the AsyncConfig (megamu.config) and the run directory, which all sit above
engines and rollout, and it reads the rollout's shard format (megamu.rollout.dataset), which engines never import
(an engines/ home would tie engines and rollout into a cycle: tests/test_structure.py).
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq

from megamu.config.loop_config import AsyncConfig
from megamu.data.prompts import PromptRecord, stop_token_ids
from megamu.engines import Engine, EngineConfig, build_engine
from megamu.engines.weights import Weights
from megamu.loop.state import QueueCursor
from megamu.mode import Mode
from megamu.observability.metrics import MetricsLogger
from megamu.rollout import RolloutConfig
from megamu.rollout.async_worker import (
    CONFIG,
    CONSUMED,
    LOADED,
    LOG,
    WEIGHTS,
    WorkerConfig,
    read_json,
    stored_shards,
    write_json,
)
from megamu.rollout.dataset import shard_name, table_to_samples
from megamu.rollout.records import RolloutSample
from megamu.run.run_dir import RunDir
from megamu.runtime import parallel

WAIT_POLL_S = 0.02  # the trainer's poll while waiting for a shard: short, the wait is the idle time it measures


class EngineProcessError(RuntimeError):
    """The engine process died: the message has its exit code and the tail of its log."""


class EngineProcess:
    """The trainer's side of the engine process: start it, take batches from its queue, point it at new weights."""

    def __init__(self, cfg: AsyncConfig, rollout: RolloutConfig, engine: EngineConfig, run_dir: RunDir, tokenizer,
                 metrics: MetricsLogger, *, max_policy_lag: int, queue: QueueCursor, mode: Mode):
        self.cfg, self.rollout, self.engine, self.run_dir, self.mode = cfg, rollout, engine, run_dir, mode
        self.tokenizer, self.metrics, self.max_policy_lag = tokenizer, metrics, max_policy_lag
        self.queue = queue  # the run state's cursor: checkpoints carry it
        self.queue_dir = run_dir.async_queue
        self.proc: subprocess.Popen | None = None
        self._shard: tuple[int, list[RolloutSample]] | None = None  # the last shard read
        self._last_return: float | None = None
        self._evaluator: Engine | None = None  # the final evaluation's (``eval_engine``)

    def start(self, weights: Weights, train_prompts: list[PromptRecord]) -> None:
        """Start the engine process on ``weights`` (an HF folder); it resumes the queue after its last stored shard."""
        if not parallel.is_main_rank():
            return
        self.queue_dir.mkdir(parents=True, exist_ok=True)
        write_json(self.queue_dir / WEIGHTS, {"version": weights.version, "hf_dir": str(weights.hf_dir)})
        write_json(self.queue_dir / CONSUMED, {"position": self.queue.cursor})
        c, r = self.cfg, self.rollout
        worker = WorkerConfig(
            queue_dir=self.queue_dir, engine=self.engine, prompts=train_prompts, seed=r.seed,
            sampling=r.sampling(0, stop_token_ids(self.tokenizer)), n_samples=r.n_samples,
            groups_per_shard=r.groups_per_shard, capacity_groups=c.queue_groups, tokenizer=self.tokenizer,
            reward=r.reward, parent_pid=os.getpid(), threads=c.worker_threads)
        (self.queue_dir / CONFIG).write_bytes(pickle.dumps(worker))
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        if c.worker_threads:  # CPU: the two processes share the cores; idle OpenMP threads must sleep, not spin
            env.update(OMP_NUM_THREADS=str(c.worker_threads), OMP_WAIT_POLICY="PASSIVE")
        if c.rollout_devices:  # GPU: the engine's servers see only the rollout GPUs
            env["CUDA_VISIBLE_DEVICES"] = c.rollout_devices
        with open(self.queue_dir / LOG, "a") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "megamu.rollout.async_worker", str(self.queue_dir)],
                                         env=env, stdout=log, stderr=subprocess.STDOUT)
        print(f"[async] engine process {self.proc.pid} started on version {weights.version}; queue cursor "
              f"{self.queue.cursor}; log {self.queue_dir / LOG}", flush=True)

    def next_batch(self, version: int, groups: int) -> tuple[list[RolloutSample], dict]:
        """The next ``groups`` groups with lag ≤ K (older ones dropped and counted) and the update's queue metrics."""
        q, now = self.queue, time.monotonic()
        if self._last_return is not None:
            q.busy_s += now - self._last_return
        payload = None
        if parallel.is_main_rank():
            start, taken, lags, idle = q.cursor, [], [], 0.0
            while len(taken) < groups:
                group, waited = self._group_at(q.cursor)
                idle += waited
                q.cursor += 1
                lag = version - group[0].policy_version
                if lag > self.max_policy_lag:
                    q.dropped_stale += len(group)
                    continue
                taken.append(q.cursor - 1)
                lags += [lag] * len(group)
            q.idle_s += idle
            write_json(self.queue_dir / CONSUMED, {"position": q.cursor})
            per = self.rollout.groups_per_shard
            stored = stored_shards(self.queue_dir, start=q.cursor // per) * per
            engine_version = (read_json(self.queue_dir / LOADED) or {}).get("version")
            payload = (taken, (q.cursor, q.dropped_stale, q.idle_s, q.busy_s), dict(
                policy_lag_mean=sum(lags) / len(lags), policy_lag_max=max(lags), trainer_idle_s=idle,
                idle_ratio=q.idle_s / max(q.idle_s + q.busy_s, 1e-9), queue_depth=stored - q.cursor,
                dropped_stale=q.dropped_stale, queue_from=start, queue_to=q.cursor,
                engine_version=engine_version))
        # rank 0 may wait long for the engine: the other ranks wait on the CPU group, not in an NCCL collective
        taken, counters, fields = parallel.broadcast_object(payload, wait=True)
        q.cursor, q.dropped_stale, q.idle_s, q.busy_s = counters
        samples = [s for pos in taken for s in self._group_at(pos)[0]]
        self._last_return = time.monotonic()
        return samples, fields

    def publish(self, weights: Weights, update: int, t_start: float) -> None:
        """Point the engine at ``weights`` (an HF folder) and log a "sync" record timed from ``t_start`` (before the
        export). Never waits for the engine (rank 0)."""
        if not parallel.is_main_rank():
            return
        write_json(self.queue_dir / WEIGHTS, {"version": weights.version, "hf_dir": str(weights.hf_dir)})
        # the engine never goes back to a version older than the one it serves now: the mode's retention
        self.mode.prune_after_sync(self.run_dir, (read_json(self.queue_dir / LOADED) or {}).get("version", -1),
                                   keep=weights.hf_dir)
        self.metrics.log("sync", step=update, update=update, version=weights.version,
                         t_sync=time.monotonic() - t_start, in_flight="finish_on_old_weights")

    def eval_engine(self, weights: Weights) -> Engine:
        """Rank 0, after the stream (the Trainer's final evaluation): the process stops, its memory is the evaluation
        engine's, and one engine starts on ``weights``' folder, as a restarted stage's does; ``stop`` shuts it down."""
        self.stop()
        self._evaluator = build_engine(self.engine, weights.hf_dir)
        return self._evaluator

    def stop(self) -> None:
        """The engine process, or the evaluation's engine that followed it, stops."""
        if self._evaluator is not None:
            self._evaluator.shutdown()
            self._evaluator = None
        if self.proc is None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc = None

    # -- internals (rank 0 waits for the engine; every rank reads the shared queue directory)
    def _group_at(self, position: int) -> tuple[list[RolloutSample], float]:
        """The group at ``position`` and the seconds spent waiting for its shard."""
        per = self.rollout.groups_per_shard
        index, t0 = position // per, time.monotonic()
        if self._shard is None or self._shard[0] != index:
            path = self.queue_dir / shard_name(index)
            if not path.exists():  # the engine must see every group passed (dropped ones too), or it may wait for us
                write_json(self.queue_dir / CONSUMED, {"position": position})
            while not path.exists():
                self._check_engine(path)
                time.sleep(WAIT_POLL_S)
            self._shard = (index, table_to_samples(pq.read_table(path)))
        g, row = self.rollout.n_samples, (position % per) * self.rollout.n_samples
        return self._shard[1][row : row + g], time.monotonic() - t0

    def _check_engine(self, waiting_for: Path) -> None:
        if self.proc is None or self.proc.poll() is None:
            return
        code, self.proc = self.proc.returncode, None
        log = self.queue_dir / LOG
        tail = log.read_text(errors="replace")[-3000:] if log.exists() else "(no log)"
        raise EngineProcessError(
            f"the async engine process exited with code {code} while the trainer waited for {waiting_for}; every "
            f"stored shard is kept: rerun the same command to resume. Last lines of {log}:\n{tail}")
