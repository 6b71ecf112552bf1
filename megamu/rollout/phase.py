"""The rollout phase: prompts -> engine -> rewards -> group advantages -> durable stage dataset.

Determinism: shard k always holds the groups of prompts[k*S:(k+1)*S], and each request's seed derives from
(base seed, stage, prompt_id), so a phase resumed after a crash produces exactly the groups of an uninterrupted run
(with SGLang, only on servers launched with --enable-deterministic-inference, i.e. --rollout-deterministic: see
megamu/engines/sglang/client.py). Each shard records whether its engine drew from seeds alone, and a resumed phase
says so.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import queue
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, replace
from pathlib import Path

import torch

from megamu.algo.dapo import OverlongShaping
from megamu.data.prompts import PromptRecord
from megamu.engines.types import Engine, GenerateRequest, SamplingParams, derive_seed
from megamu.rollout.dataset import (
    MANIFEST,
    StageManifest,
    combined_mode,
    group_stats,
    read_manifest,
    shard_info,
    shard_mode,
    shard_name,
    write_manifest,
    write_shard,
)
from megamu.rollout.records import RolloutSample
from megamu.runtime.atomic import atomic_write
from megamu.runtime.faults import crash_point

PLAN = "plan.json"


def _score(scorer, responses: list[str], truths: list[str], metas: list, group_size: int) -> list[float]:
    from megamu.reward.pool import RewardScorer

    if isinstance(scorer, RewardScorer):  # the rows' data_source and extra_info, for verl and slime functions
        return scorer.score(responses, truths, metas, group_size=group_size)
    return scorer.score(responses, truths) if hasattr(scorer, "score") else list(scorer(responses, truths))


def stage_requests(prompts: list[PromptRecord], sampling: SamplingParams, n_samples: int,
                   stage: int) -> list[GenerateRequest]:
    """One request per prompt; its seed derives from (base seed, stage, prompt_id) alone (a None seed counts as 0)."""
    base_seed = sampling.seed if sampling.seed is not None else 0
    return [
        GenerateRequest(p.prompt_id, p.prompt_ids, replace(sampling, n=n_samples,
                                                           seed=derive_seed(base_seed, stage, p.prompt_id)),
                        source=getattr(p, "source", ""))
        for p in prompts
    ]


def score_groups(engine: Engine, prompts: list[PromptRecord], out: list, n_samples: int, scorer, tokenizer, *,
                 stage: int, policy_version: int, overlong: OverlongShaping | None = None) -> list[list[RolloutSample]]:
    """Check the engine's samples for ``prompts``, score them and compute group advantages (Eq. 1); ``overlong``:
    DAPO's soft overlong punishment added to each reward before the advantages (the reward trained on)."""
    from megamu.algo import group_advantages

    expected = [(p.prompt_id, j) for p in prompts for j in range(n_samples)]
    if [(s.prompt_id, s.sample_index) for s in out] != expected:
        raise RuntimeError(f"engine {type(engine).__name__} returned samples out of order or incomplete "
                           f"({len(out)} samples for {len(prompts)} prompts x {n_samples})")
    for s in out:  # the trainer needs one behaviour log-prob per response token it trains on
        if len(s.output_ids) != len(s.output_logprobs):
            raise RuntimeError(f"engine {type(engine).__name__} returned {len(s.output_ids)} tokens but "
                               f"{len(s.output_logprobs)} log-probs for prompt {s.prompt_id} sample {s.sample_index}")
    texts = tokenizer.batch_decode([s.output_ids for s in out], skip_special_tokens=True)
    rendered = tokenizer.batch_decode([p.prompt_ids for p in prompts])  # what the model read (slime's sample.prompt)
    metas = [replace(prompts[i // n_samples].meta, rendered_prompt=rendered[i // n_samples],
                     finish_reason=s.finish_reason, prompt_ids=list(prompts[i // n_samples].prompt_ids),
                     response_ids=list(s.output_ids)) for i, s in enumerate(out)]
    rewards = _score(scorer, texts, [p.answer for p in prompts for _ in range(n_samples)], metas, n_samples)
    if overlong is not None:
        rewards = [r + p for r, p in zip(rewards, overlong.penalties([len(s.output_ids) for s in out]))]
    adv = group_advantages(torch.tensor(rewards, dtype=torch.float32).view(len(prompts), n_samples)).flatten().tolist()
    samples = [
        RolloutSample(
            prompt_id=s.prompt_id, sample_index=s.sample_index, prompt_ids=list(prompts[i // n_samples].prompt_ids),
            response_ids=s.output_ids, behaviour_logprobs=s.output_logprobs, reward=float(rewards[i]),
            advantage=float(adv[i]), finish_reason=s.finish_reason, stage=stage, policy_version=policy_version,
        )
        for i, s in enumerate(out)
    ]
    return [samples[g * n_samples : (g + 1) * n_samples] for g in range(len(prompts))]


def generate_groups(
    engine: Engine,
    prompts: list[PromptRecord],
    sampling: SamplingParams,
    n_samples: int,
    scorer,
    tokenizer,
    *,
    stage: int = 0,
    policy_version: int = 0,
) -> list[list[RolloutSample]]:
    """One group of ``n_samples`` scored samples per prompt, with group advantages (Eq. 1); in memory.

    ``scorer`` has ``score(responses, ground_truths) -> list[float]`` (e.g. ``RewardScorer``). A None
    ``sampling.seed`` counts as 0, so every phase is reproducible.
    """
    out = engine.generate(stage_requests(prompts, sampling, n_samples, stage))
    return score_groups(engine, prompts, out, n_samples, scorer, tokenizer, stage=stage,
                        policy_version=policy_version)


def _streamed_shards(engine, shard_requests: dict[int, list[GenerateRequest]], max_in_flight: int):
    """Yield (shard, its samples in request order) as each shard's last request finishes.

    Up to ``max_in_flight`` requests run at all times: each finished request starts the next one (from the done
    callback, so the servers stay busy while the caller scores and writes a shard), in shard order."""
    pending = deque((k, i, r) for k, reqs in shard_requests.items() for i, r in enumerate(reqs))
    results = {k: [None] * len(reqs) for k, reqs in shard_requests.items()}
    left = {k: len(reqs) for k, reqs in shard_requests.items()}
    done: queue.Queue = queue.Queue()
    # Reentrant: a future that is already done runs its callback (start_next) inside add_done_callback.
    lock, futures, index = threading.RLock(), set(), itertools.count()
    stopped = threading.Event()

    def start_next(finished=None) -> None:
        with lock:
            if finished is not None:
                futures.discard(finished)
            while pending and len(futures) < max_in_flight and not stopped.is_set():
                k, i, req = pending.popleft()
                f = engine.submit(next(index), req)
                futures.add(f)
                f.add_done_callback(lambda f, k=k, i=i: (done.put((k, i, f)), start_next(f)))

    try:
        start_next()
        while any(left.values()):
            k, i, f = done.get()
            results[k][i] = f.result()  # a failed request ends the phase; shards written so far stay
            left[k] -= 1
            if left[k] == 0:
                yield k, [s for r in results.pop(k) for s in r]
    finally:
        stopped.set()
        with lock:
            for f in list(futures):  # a cancelled future's callback runs here, at once, and leaves the set
                f.cancel()


def _called_shards(engine, shard_requests: dict[int, list[GenerateRequest]], shards_per_call: int):
    """For engines that take whole calls (``max_in_flight`` 0: LocalEngine): one ``generate`` call per
    ``shards_per_call`` shards, the next call running in a thread while the caller scores and writes the shards of
    the last one."""
    keys = list(shard_requests)
    calls = [keys[c : c + shards_per_call] for c in range(0, len(keys), shards_per_call)]
    gen = lambda call: engine.generate([r for k in call for r in shard_requests[k]])
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rollout-generate")
    try:
        ahead = pool.submit(gen, calls[0]) if calls else None
        for c, call in enumerate(calls):
            out = ahead.result()
            ahead = pool.submit(gen, calls[c + 1]) if c + 1 < len(calls) else None
            for k in call:
                n = sum(r.sampling.n for r in shard_requests[k])
                yield k, out[:n]
                out = out[n:]
    finally:  # on an error, do not wait for the call generating ahead
        pool.shutdown(wait=False, cancel_futures=True)


def _mode_words(deterministic: bool | None) -> str:
    return {True: "deterministically (from seeds alone)", False: "non-deterministically (seeds ignored)",
            None: "in an unknown mode (seeds may be ignored)"}[deterministic]


def _check_plan(out: Path, plan: dict) -> None:
    """Refuse to resume a directory that was started with different prompts or settings."""
    path = out / PLAN
    if path.exists():
        old = json.loads(path.read_text())
        if old != plan:
            diff = sorted(k for k in set(old) | set(plan) if old.get(k) != plan.get(k))
            raise RuntimeError(f"{out} holds a rollout started with different settings ({', '.join(diff)}); "
                               "use a fresh directory or restore the original settings")
    else:
        atomic_write(path, lambda p: p.write_text(json.dumps(plan, indent=2)))


def run_rollout_phase(
    engine: Engine,
    prompts: list[PromptRecord],
    out_dir: str | Path,
    *,
    sampling: SamplingParams,
    n_samples: int,
    scorer,
    tokenizer,
    stage: int,
    policy_version: int = 0,
    groups_per_shard: int = 16,
    shards_per_call: int = 1,
    model_path: str = "",
    max_in_flight: int | None = None,
    overlong: OverlongShaping | None = None,
) -> StageManifest:
    """Generate, score and write a whole stage, resuming at the first missing shard; returns the manifest.

    An engine with ``max_in_flight`` > 0 (SGLang) gets a continuous stream: that many requests (or ``max_in_flight``
    given here) are kept running across shard boundaries, and each shard is scored and written as soon as its last
    group is in, while generation goes on. Other engines get ``shards_per_call`` shards per ``generate`` call, the
    next call running while the last one's shards are scored and written. Either way a shard's contents depend only
    on its prompts and seeds, and a crash loses only the shards not yet written.
    """
    out = Path(out_dir)
    if (out / MANIFEST).exists():
        return _finished_stage(out, len(prompts), n_samples)
    out.mkdir(parents=True, exist_ok=True)
    sampling = replace(sampling, n=n_samples, seed=sampling.seed if sampling.seed is not None else 0)
    prompts_sha256 = hashlib.sha256(json.dumps([p.prompt_ids for p in prompts]).encode()).hexdigest()
    _check_plan(out, dict(stage=stage, n_samples=n_samples, groups_per_shard=groups_per_shard,
                          sampling=asdict(sampling), prompt_ids=[p.prompt_id for p in prompts],
                          prompts_sha256=prompts_sha256, **({"overlong": asdict(overlong)} if overlong else {})))
    chunks = [prompts[i : i + groups_per_shard] for i in range(0, len(prompts), groups_per_shard)]
    done = [(out / shard_name(k)).exists() for k in range(len(chunks))]
    todo = sum(len(c) for c, d in zip(chunks, done) if not d) * n_samples
    mode = getattr(engine, "deterministic", None)
    if any(done):
        _announce_resume(out, stage, done, mode)
    missing = [k for k in range(len(chunks)) if not done[k]]
    progress = _Progress(stage, todo, len(missing), groups_per_shard)
    shard_requests = {k: stage_requests(chunks[k], sampling, n_samples, stage) for k in missing}
    engine.check_requests([r for reqs in shard_requests.values() for r in reqs])  # every bad prompt, before any work
    engine.begin_stage()
    in_flight = max_in_flight or engine.max_in_flight
    stream = _streamed_shards(engine, shard_requests, in_flight) if in_flight else \
        _called_shards(engine, shard_requests, shards_per_call)
    t_last = time.monotonic()
    progress.watch(scorer)
    for k, generated in stream:
        shard = score_groups(engine, chunks[k], generated, n_samples, scorer, tokenizer, stage=stage,
                             policy_version=policy_version, overlong=overlong)
        now = time.monotonic()
        # the shards' times add up to the phase's
        write_shard(out, k, shard, t_generate_s=now - t_last, deterministic=mode)
        t_last = now
        progress.count([s for g in shard for s in g])
        crash_point("shard", k)
        progress.report()
    progress.close()
    manifest = finish_stage(out, len(chunks), n_samples, stage, policy_version, sampling, engine, model_path,
                            progress.failures(), overlong)
    _print_stage_summary(manifest, stage, n_samples)
    return manifest


def _finished_stage(out: Path, num_groups: int, n_samples: int) -> StageManifest:
    """The manifest of a stage already written in ``out``, if it is the stage asked for."""
    manifest = read_manifest(out)
    if manifest.num_groups != num_groups or manifest.group_size != n_samples:
        raise RuntimeError(f"{out / MANIFEST} is a finished stage of {manifest.num_groups} groups x "
                           f"{manifest.group_size}, not {num_groups} x {n_samples}; use a fresh directory")
    return manifest


def _announce_resume(out: Path, stage: int, done: list[bool], mode: bool | None) -> None:
    """The line a resumed stage starts with: how many shards are in, how they and the missing ones are drawn."""
    print(f"[rollout] stage {stage}: resuming, {sum(done)}/{len(done)} shards already in {out}, made "
          f"{_mode_words(combined_mode([shard_mode(out / shard_name(k)) for k in range(len(done)) if done[k]]))}"
          f"; the missing shards are drawn {_mode_words(mode)}"
          + ("" if mode else " (new samples, not those an uninterrupted run would have drawn; "
                                             "--rollout-deterministic makes SGLang honour the seeds)"))


class _Progress:
    """A stage's progress bar: samples, tokens and reward so far, one estimate of the time left after the first
    shard, and the reward calls that failed in this stage (counted from ``watch``)."""

    def __init__(self, stage: int, todo: int, num_missing: int, groups_per_shard: int):
        from tqdm import tqdm

        self.stage, self.num_missing, self.groups_per_shard = stage, num_missing, groups_per_shard
        self.bar = tqdm(total=todo, desc=f"rollout stage {stage}", unit="sample", dynamic_ncols=True)
        self.n_tokens, self.reward_sum, self.n_done, self.t0 = 0, 0.0, 0, time.monotonic()
        self.written = 0
        self.scorer, self.errors0, self.timeouts0 = None, 0, 0

    def watch(self, scorer) -> None:
        """Count the reward failures of ``scorer`` from now on."""
        self.scorer = scorer
        self.errors0, self.timeouts0 = getattr(scorer, "num_errors", 0), getattr(scorer, "num_timeouts", 0)

    def failures(self) -> dict[str, int]:
        return reward_failures(self.scorer, self.errors0, self.timeouts0)

    def count(self, samples: list[RolloutSample]) -> None:
        """A shard written: its samples, tokens and rewards."""
        self.n_tokens += sum(s.response_length for s in samples)
        self.reward_sum += sum(s.reward for s in samples)
        self.n_done += len(samples)
        self.bar.update(len(samples))

    def report(self) -> None:
        dt = max(time.monotonic() - self.t0, 1e-9)
        self.written += 1
        # one estimate, as soon as there is a measured shard to base it on
        if self.written == 1 and self.num_missing > 1:
            self.bar.write(f"[rollout] stage {self.stage}: {dt:.0f}s for the first shard of {self.groups_per_shard} "
                           f"groups on this machine: about {(self.num_missing - 1) * dt / 60:.1f} min more for this "
                           "stage's rollout")
        failed = self.failures()
        self.bar.set_postfix(samples_s=f"{self.n_done / dt:.1f}", tok_s=f"{self.n_tokens / dt:.0f}",
                             reward=f"{self.reward_sum / max(self.n_done, 1):.3f}",
                             reward_errors=failed["reward_errors"], reward_timeouts=failed["reward_timeouts"])

    def close(self) -> None:
        self.bar.close()


def _print_stage_summary(manifest: StageManifest, stage: int, n_samples: int) -> None:
    servers = manifest.extra.get("servers") or []
    if servers:
        print(f"[rollout] stage {stage}: per server (requests, samples/s, restarts): " + ", ".join(
            f"{s['url']} {s['requests']} {s['samples_per_s']:.1f}/s {s['restarts']}" for s in servers))
    print(
        f"[rollout] stage {stage}: {manifest.num_groups} groups x {n_samples} in {manifest.t_rollout_s:.1f}s | "
        f"reward {manifest.reward_mean:.3f} | all-correct {manifest.all_correct_fraction:.2f} "
        f"all-wrong {manifest.all_wrong_fraction:.2f} | truncated {manifest.truncation_rate:.2f} | "
        f"mean length {manifest.mean_response_length:.1f} | reward errors {manifest.extra.get('reward_errors', 0)}, "
        f"timeouts {manifest.extra.get('reward_timeouts', 0)}"
    )


def reward_failures(scorer, errors0: int, timeouts0: int) -> dict[str, int]:
    """The reward calls that raised and that timed out since the counts ``errors0`` and ``timeouts0`` (this stage's,
    in this process: a resumed stage counts its new shards)."""
    return {"reward_errors": getattr(scorer, "num_errors", 0) - errors0,
            "reward_timeouts": getattr(scorer, "num_timeouts", 0) - timeouts0}


def finish_stage(out: Path, num_shards: int, group_size: int, stage: int, policy_version: int,
                 sampling: SamplingParams, engine, model_path: str, failures: dict,
                 overlong: OverlongShaping | None = None) -> StageManifest:
    """Checksum every shard, compute the statistics from what is on disk, and write the manifest last."""
    import pyarrow.parquet as pq

    infos, rewards, finish, lengths = [], [], [], []
    for k in range(num_shards):
        path = out / shard_name(k)
        infos.append(shard_info(path))
        cols = pq.read_table(path, columns=["reward", "finish_reason", "response_length"]).to_pydict()
        rewards += [cols["reward"][i : i + group_size] for i in range(0, len(cols["reward"]), group_size)]
        finish += cols["finish_reason"]
        lengths += cols["response_length"]
    manifest = StageManifest(
        stage=stage, num_groups=len(rewards), group_size=group_size, num_shards=num_shards, shards=infos,
        sampling=asdict(sampling), engine=engine.name, model_path=str(model_path),
        policy_version=policy_version, t_rollout_s=sum(i.t_generate_s for i in infos),
        deterministic=combined_mode([i.deterministic for i in infos]), **group_stats(rewards, finish, lengths),
        extra={**failures, **({"servers": servers} if (servers := engine.server_stats()) else {}),
               # replies within the overlong buffer: their reward carries DAPO's length penalty
               **({"overlong_fraction": sum(map(overlong.punished, lengths)) / max(len(lengths), 1)}
                  if overlong else {})},
    )
    write_manifest(out, manifest)
    return manifest
