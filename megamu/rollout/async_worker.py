"""The async rollout engine process (``--rollout-mode async``, paper §5.1) and the durable queue it fills.

Run as ``python -m megamu.rollout.async_worker <queue_dir>``: a fresh interpreter (no forked torch/OpenMP state,
no re-import of the trainer's ``__main__``), started and stopped by ``megamu.loop.engine_process.EngineProcess``.

The queue directory ``<run>/rollouts/async/`` holds:
- ``shard-NNNNN.parquet``: complete scored groups, the stage-dataset shard format (megamu.rollout.dataset). Shard k
  holds the groups at queue positions k·S .. k·S+S-1 (S = --rollout-groups-per-shard); the group at position q is
  the prompt at position q of the run's epoch stream, with prompt_id = q, so positions are unique over the run.
- ``weights.json`` (trainer -> worker): the policy version to generate with and the HF folder holding it.
- ``consumed.json`` (trainer -> worker): the trainer's queue cursor; the worker stays at most ``capacity_groups``
  stored-but-unconsumed groups ahead of it (back-pressure, which is what keeps the policy lag small).
- ``loaded.json`` (worker -> trainer): the version the engine serves now and how long its reload took.
- ``worker.lock``: held by the live worker, so a worker orphaned by a killed trainer finishes its shard and exits
  before a new one starts writing; ``worker.log``: the worker's output.

A weight sync never interrupts a generate call: the worker polls ``weights.json`` only between shards, so requests
in flight at a sync finish on the old weights and keep the old version; the engine reloads before the next shard.
"""

from __future__ import annotations

import fcntl
import json
import os
import pickle
import signal
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

from megamu.data.order import epoch_stream
from megamu.data.prompts import PromptRecord
from megamu.engines import EngineConfig
from megamu.engines.types import SamplingParams
from megamu.reward.config import RewardConfig
from megamu.rollout.dataset import shard_name, write_shard
from megamu.runtime.atomic import atomic_write_text
from megamu.runtime.faults import crash_point

CONFIG, WEIGHTS, CONSUMED, LOADED, LOCK, LOG = (
    "worker_config.pkl", "weights.json", "consumed.json", "loaded.json", "worker.lock", "worker.log")
POLL_S = 0.05  # the worker's wait between checks of weights.json / consumed.json when the queue is full


@dataclass
class WorkerConfig:
    """Everything the engine process needs, pickled into the queue directory by the trainer."""

    queue_dir: Path
    engine: EngineConfig
    prompts: list[PromptRecord]  # the training prompts; the epoch stream over them gives position q's prompt
    seed: int  # of the epoch stream
    sampling: SamplingParams
    n_samples: int
    groups_per_shard: int
    capacity_groups: int
    tokenizer: object
    reward: RewardConfig
    parent_pid: int
    threads: int | None = None  # CPU: torch threads of this process (the trainer takes the others)


def read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None


def write_json(path: Path, data: dict) -> None:
    atomic_write_text(path, json.dumps(data))


def stored_shards(queue_dir: Path, start: int = 0) -> int:
    """Number of contiguous shards from shard 0, given that shards 0..start-1 exist (a shard is whole or absent)."""
    k = start
    while (queue_dir / shard_name(k)).exists():
        k += 1
    return k


def prompts_at(prompts: list[PromptRecord], seed: int, start: int, count: int) -> list[PromptRecord]:
    """The prompts at queue positions start .. start+count-1, each with prompt_id = its position."""
    picked = epoch_stream(len(prompts), seed, start, count)
    return [replace(prompts[i], prompt_id=start + j) for j, i in enumerate(picked)]


def run_worker(cfg: WorkerConfig) -> None:
    import torch

    from megamu.engines import build_engine
    from megamu.reward import make_scorer
    from megamu.rollout.phase import generate_groups

    print(f"[async worker {os.getpid()}] started by trainer {cfg.parent_pid}", flush=True)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    q, per_shard = Path(cfg.queue_dir), cfg.groups_per_shard
    lock = open(q / LOCK, "w")  # noqa: SIM115 - held for the life of the process
    fcntl.flock(lock, fcntl.LOCK_EX)  # wait for an orphaned worker to finish its shard
    # SIGTERM (the trainer's stop) unwinds through ``finally``, so SGLang servers this engine started are shut down.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    scorer = make_scorer(cfg.reward)
    engine = None
    try:
        weights = read_json(q / WEIGHTS)
        engine = build_engine(cfg.engine, weights["hf_dir"])
        version = weights["version"]
        write_json(q / LOADED, {"version": version, "t_reload_s": 0.0})
        k = stored_shards(q)
        print(f"[async worker {os.getpid()}] engine up on version {version}; next shard {k}", flush=True)
        while os.getppid() == cfg.parent_pid:  # the trainer is gone: stop (its successor starts a new worker)
            weights = read_json(q / WEIGHTS)
            if weights["version"] != version:
                t0 = time.monotonic()
                engine.update_weights(hf_dir=weights["hf_dir"])
                version = weights["version"]
                write_json(q / LOADED, {"version": version, "t_reload_s": time.monotonic() - t0})
            consumed = (read_json(q / CONSUMED) or {"position": 0})["position"]
            if k * per_shard - consumed >= cfg.capacity_groups:
                time.sleep(POLL_S)
                continue
            t0 = time.monotonic()
            prompts = prompts_at(cfg.prompts, cfg.seed, k * per_shard, per_shard)
            groups = generate_groups(engine, prompts, cfg.sampling, cfg.n_samples, scorer, cfg.tokenizer, stage=0,
                                     policy_version=version)
            write_shard(q, k, groups, t_generate_s=time.monotonic() - t0)
            crash_point("shard", k)  # tests: the engine process dies here, like a kill
            k += 1
        print(f"[async worker {os.getpid()}] trainer {cfg.parent_pid} is gone; exiting", flush=True)
    finally:
        if engine is not None:
            engine.shutdown()
        scorer.close()


if __name__ == "__main__":
    queue = Path(sys.argv[1])
    with open(queue / CONFIG, "rb") as f:
        run_worker(pickle.load(f))
