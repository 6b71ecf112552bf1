"""DAPO's dynamic sampling for a stage (arXiv 2503.14476 §3.2): generate, drop the groups whose values of the filter
metric are all equal (by rewards: their advantages are all zero, no gradient), generate more prompts' groups, until
the stage holds its B_train informative groups or ``max_rounds`` generation rounds have run (verl's
``max_num_gen_batches``, 0: no limit; verl-recipe dapo/dapo_ray_trainer.py ``fit``: it keeps generating batches of
data.gen_batch_size prompts and concatenating the kept groups until the train batch is full, then keeps its first
train_batch_size groups; past the bound it raises ValueError).

Each round is a complete, resumable rollout phase of its own (``<stage>/sampling/round_r``); the stage's dataset is
then assembled from the rounds' kept groups in round order, renumbered 0..B_train-1, and its manifest records the
rounds in ``extra["dynamic_sampling"]``. Short of informative groups after the last round, the stage is an error as
in verl (``ShortStageError``; the rounds stay on disk, so a restart resumes them), or, with ``fill``, it is filled up
with dropped groups (zero advantage when filtered by reward: they change no update) and says how many
(``filled_groups``): μ = B_train / B_mini updates still find their minibatches.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch

from megamu.algo.dapo import filter_values, informative_groups
from megamu.data.prompts import PromptRecord
from megamu.engines.types import Engine
from megamu.rollout.dataset import MANIFEST, StageDataset, StageManifest, combined_mode, read_manifest, write_shard
from megamu.rollout.phase import finish_stage, run_rollout_phase

SAMPLING_DIR = "sampling"


class ShortStageError(RuntimeError):
    """Dynamic sampling's rounds ran out before the stage held its informative groups (verl raises here too)."""


def run_dynamic_rollout(engine: Engine, prompts_of_round: Callable[[int], list[PromptRecord]], out_dir: str | Path,
                        *, max_rounds: int, n_samples: int, stage: int, target: int | None = None,
                        metric: str = "seq_reward", fill: bool = False, groups_per_shard: int = 16,
                        **phase_kwargs) -> StageManifest:
    """The stage's dataset in ``out_dir``: round r generates ``prompts_of_round(r)`` (round 0 begins with the stage's
    own B_train prompts), each through ``run_rollout_phase`` (``phase_kwargs``: its other arguments), until ``target``
    groups (None: round 0's prompt count) have unequal ``metric`` values (megamu.algo.dapo.FILTER_METRICS) or
    ``max_rounds`` rounds ran (0: no limit)."""
    out = Path(out_dir)
    if (out / MANIFEST).exists():
        return read_manifest(out)
    target = target or len(prompts_of_round(0))
    overlong = phase_kwargs.get("overlong")
    kept: list[list] = []
    dropped: list[list] = []
    rounds: list[StageManifest] = []
    r = 0
    while max_rounds == 0 or r < max_rounds:
        rounds.append(run_rollout_phase(engine, prompts_of_round(r), out / SAMPLING_DIR / f"round_{r}",
                                        n_samples=n_samples, stage=stage, groups_per_shard=groups_per_shard,
                                        **phase_kwargs))
        groups = StageDataset(out / SAMPLING_DIR / f"round_{r}").groups()
        rewards = torch.tensor([[s.reward for s in g] for g in groups], dtype=torch.float64)
        penalties = torch.tensor([overlong.penalties([s.response_length for s in g]) for g in groups],
                                 dtype=torch.float64) if overlong else torch.zeros_like(rewards)
        informative = informative_groups(filter_values(rewards, penalties, metric))
        for g, keep in zip(groups, informative.tolist()):
            (kept if keep else dropped).append(g)
        r += 1
        if len(kept) >= target:
            break
    if len(kept) < target and not fill:
        raise ShortStageError(
            f"stage {stage}: dynamic sampling found {len(kept)} of {target} groups with unequal {metric} in "
            f"{len(rounds)} generation rounds (--max-sampling-rounds {max_rounds}), as verl's max_num_gen_batches "
            "raises: the data may be too hard or too easy. --max-sampling-rounds 0 keeps generating; "
            "--fill-short-stage fills the stage with equal-valued groups instead")
    filled = max(0, target - len(kept))
    if filled:
        print(f"[rollout] stage {stage}: dynamic sampling found {len(kept)} of {target} groups with unequal {metric} "
              f"in {len(rounds)} rounds (--max-sampling-rounds); {filled} groups of equal {metric} fill the stage "
              "(--fill-short-stage)", flush=True)
    chosen = kept[:target] + dropped[:filled]
    chosen = [[replace(s, prompt_id=i) for s in g] for i, g in enumerate(chosen)]
    t_total = sum(m.t_rollout_s for m in rounds)
    deterministic = combined_mode([m.deterministic for m in rounds])
    shards = [chosen[i : i + groups_per_shard] for i in range(0, target, groups_per_shard)]
    for k, shard in enumerate(shards):  # the rounds' generation time, spread over the shards by their groups
        write_shard(out, k, shard, t_generate_s=t_total * len(shard) / target, deterministic=deterministic)
    record = {"rounds": len(rounds), "generated_groups": sum(m.num_groups for m in rounds),
              "dropped_groups": len(dropped), "filled_groups": filled}
    extra = {key: sum(m.extra.get(key, 0) for m in rounds) for key in ("reward_errors", "reward_timeouts")}
    sampling = phase_kwargs["sampling"]  # as run_rollout_phase records it
    sampling = replace(sampling, n=n_samples, seed=sampling.seed if sampling.seed is not None else 0)
    manifest = finish_stage(out, len(shards), n_samples, stage, phase_kwargs.get("policy_version", 0), sampling,
                            engine, phase_kwargs.get("model_path", ""), {**extra, "dynamic_sampling": record},
                            phase_kwargs.get("overlong"))
    shutil.rmtree(out / SAMPLING_DIR)  # the stage's dataset is durable (manifest written last): the rounds go
    return manifest
