"""``--rollout-mode async`` on the trainer's side (paper §5.1, Table 2): rollout and training at the same time.

An engine process (megamu.rollout.async_worker) generates continuously into a durable queue of Parquet shards; the
trainer takes ``--prompts-per-update`` groups per update in queue order, dropping (and counting) every group whose
policy lag, trainer version − the version that generated it, exceeds ``--max-policy-lag``; every
``--weight-sync-interval`` updates it exports θ as an HF folder and points the engine at it. In-flight requests at a
sync finish on the old weights and keep their version (the engine reloads between shards).

Resume: the queue cursor (groups consumed, trained or dropped), the drop count and the idle/busy times travel in the
checkpoint, so a resumed run continues at the first group the checkpointed weights never consumed; groups the engine
stored after that stay in the queue and are consumed, none twice. Which weights generated which group depends on the
engine's timing, so an async run is not bitwise reproducible (a staged run is).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq

from megamu import parallel
from megamu.records import RolloutSample
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
from megamu.rollout.modes import Rollout

WAIT_POLL_S = 0.02  # the trainer's poll while waiting for a shard: short, the wait is the idle time it measures


class EngineProcessError(RuntimeError):
    """The engine process died: the message has its exit code and the tail of its log."""


class AsyncRollout(Rollout):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.queue_dir = self.cfg.run_dir / "rollouts" / "async"
        self.cursor = 0  # queue position of the next group to consume
        self.dropped_stale = 0  # samples dropped for lag > K (cumulative over the run)
        self.idle_s = self.busy_s = 0.0  # time waiting for samples / everything else the trainer did
        self.proc: subprocess.Popen | None = None
        self._shard: tuple[int, list[RolloutSample]] | None = None  # the last shard read
        self._last_return: float | None = None

    # -- progress that survives a restart (Run.checkpoint stores it, Run.__init__ gives it back)
    def state(self) -> dict:
        return {"cursor": self.cursor, "dropped_stale": self.dropped_stale, "idle_s": self.idle_s,
                "busy_s": self.busy_s}

    def restore(self, state: dict) -> None:
        self.cursor, self.dropped_stale = state["cursor"], state["dropped_stale"]
        self.idle_s, self.busy_s = state["idle_s"], state["busy_s"]

    # -- the loop's three calls
    def start(self, policy, train_prompts) -> None:
        """Export θ and start the engine process on it; it resumes the queue after its last stored shard."""
        if parallel.is_main_rank():
            self.queue_dir.mkdir(parents=True, exist_ok=True)
            # Sync folders past this checkpoint came from a lost timeline: same names would hold other weights.
            for old in (self.cfg.run_dir / "hf").glob("sync_*"):
                shutil.rmtree(old, ignore_errors=True)
        parallel.barrier()
        hf_dir = policy.export(f"sync_{policy.version:07d}")
        if not parallel.is_main_rank():
            return
        write_json(self.queue_dir / WEIGHTS, {"version": policy.version, "hf_dir": str(hf_dir)})
        write_json(self.queue_dir / CONSUMED, {"position": self.cursor})
        c = self.cfg
        worker = WorkerConfig(
            queue_dir=self.queue_dir, engine=c.engine, prompts=train_prompts, seed=c.seed, sampling=self.sampling(0),
            n_samples=c.n_samples, groups_per_shard=c.groups_per_shard, capacity_groups=c.queue_groups,
            tokenizer=self.tokenizer, reward=c.reward, parent_pid=os.getpid(), threads=c.worker_threads)
        import pickle

        (self.queue_dir / CONFIG).write_bytes(pickle.dumps(worker))
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        if c.worker_threads:  # CPU: the two processes share the cores; idle OpenMP threads must sleep, not spin
            env.update(OMP_NUM_THREADS=str(c.worker_threads), OMP_WAIT_POLICY="PASSIVE")
        if c.rollout_devices:  # GPU: the engine's servers see only the rollout GPUs
            env["CUDA_VISIBLE_DEVICES"] = c.rollout_devices
        with open(self.queue_dir / LOG, "a") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "megamu.rollout.async_worker", str(self.queue_dir)],
                                         env=env, stdout=log, stderr=subprocess.STDOUT)
        print(f"[async] engine process {self.proc.pid} started on version {policy.version}; queue cursor "
              f"{self.cursor}; log {self.queue_dir / LOG}", flush=True)

    def next_batch(self, version: int, groups: int) -> tuple[list[RolloutSample], dict]:
        """The next ``groups`` groups with lag ≤ K (older ones dropped and counted) and the update's queue metrics."""
        now = time.monotonic()
        if self._last_return is not None:
            self.busy_s += now - self._last_return
        payload = None
        if parallel.is_main_rank():
            start, taken, lags, idle = self.cursor, [], [], 0.0
            while len(taken) < groups:
                group, waited = self._group_at(self.cursor)
                idle += waited
                self.cursor += 1
                lag = version - group[0].policy_version
                if lag > self.cfg.max_policy_lag:
                    self.dropped_stale += len(group)
                    continue
                taken.append(self.cursor - 1)
                lags += [lag] * len(group)
            self.idle_s += idle
            write_json(self.queue_dir / CONSUMED, {"position": self.cursor})
            per = self.cfg.groups_per_shard
            stored = stored_shards(self.queue_dir, start=self.cursor // per) * per
            engine_version = (read_json(self.queue_dir / LOADED) or {}).get("version")
            payload = (taken, self.state(), dict(
                policy_lag_mean=sum(lags) / len(lags), policy_lag_max=max(lags), trainer_idle_s=idle,
                idle_ratio=self.idle_s / max(self.idle_s + self.busy_s, 1e-9), queue_depth=stored - self.cursor,
                dropped_stale=self.dropped_stale, queue_from=start, queue_to=self.cursor,
                engine_version=engine_version))
        taken, state, fields = _broadcast(payload)
        self.restore(state)
        samples = [s for pos in taken for s in self._group_at(pos)[0]]
        self._last_return = time.monotonic()
        return samples, fields

    def sync(self, policy, update: int) -> None:
        """Export θ (collective) and point the engine at it; logs a "sync" record. Never waits for the engine."""
        t0 = time.monotonic()
        hf_dir = policy.export(f"sync_{policy.version:07d}")
        if parallel.is_main_rank():
            write_json(self.queue_dir / WEIGHTS, {"version": policy.version, "hf_dir": str(hf_dir)})
            self._remove_unused_syncs(keep=hf_dir)
            self.metrics.log("sync", step=update, update=update, version=policy.version,
                             t_sync=time.monotonic() - t0, in_flight="finish_on_old_weights")

    def close(self) -> None:
        self.stop_engine()
        super().close()

    def stop_engine(self) -> None:
        if self.proc is None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc = None

    def evaluate_final(self, hf_dir: Path, stage: int) -> None:
        self.stop_engine()  # the engine process's memory is free for the evaluation engine
        super().evaluate_final(hf_dir, stage)

    # -- internals (rank 0 waits for the engine; every rank reads the shared queue directory)
    def _group_at(self, position: int) -> tuple[list[RolloutSample], float]:
        """The group at ``position`` and the seconds spent waiting for its shard."""
        per = self.cfg.groups_per_shard
        index, t0 = position // per, time.monotonic()
        if self._shard is None or self._shard[0] != index:
            path = self.queue_dir / shard_name(index)
            if not path.exists():  # the engine must see every group passed (dropped ones too), or it may wait for us
                write_json(self.queue_dir / CONSUMED, {"position": position})
            while not path.exists():
                self._check_engine(path)
                time.sleep(WAIT_POLL_S)
            self._shard = (index, table_to_samples(pq.read_table(path)))
        g, row = self.cfg.n_samples, (position % per) * self.cfg.n_samples
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

    def _remove_unused_syncs(self, keep: Path) -> None:
        """Delete sync folders older than the one the engine serves now (it never goes back to them)."""
        loaded = (read_json(self.queue_dir / LOADED) or {}).get("version", -1)
        for old in (self.cfg.run_dir / "hf").glob("sync_*"):
            if old != keep and int(old.name.removeprefix("sync_")) < loaded:
                shutil.rmtree(old, ignore_errors=True)


def _broadcast(payload):
    """Rank 0's batch decision to every rank (a no-op in a world of one)."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return payload
    box = [payload]
    dist.broadcast_object_list(box, src=0)
    return box[0]
