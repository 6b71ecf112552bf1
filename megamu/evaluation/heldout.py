"""Evaluation during a run (rank 0): before the first update, every --eval-interval updates where the engine already
holds the policy (a stage boundary), and after the last update, on the held-out split and on named sets.

Each set gets greedy accuracy (one top-k 1 reply of the T = 1 distribution per problem) and, with k =
``n_samples_per_eval_prompt``, sampled pass@1 averaged over k replies at ``eval_temperature`` (the paper's avg@k,
App. B) and pass@k (any of the k given the reward's full score, 1: a math answer verified, every test of a code
problem passed). Scores come from the run's reward; each set is one "eval" record (tensorboard: eval/<set>/<field>)."""

from __future__ import annotations

import time
from dataclasses import replace

from megamu.config.loop_config import EvalConfig
from megamu.data.prompts import PromptRecord
from megamu.engines import Engine
from megamu.engines.types import SamplingParams
from megamu.evaluation.metrics import avg_at_k
from megamu.observability.metrics import MetricsLogger
from megamu.rollout.phase import generate_groups


def evaluate_sets(engine: Engine, sets: dict[str, list[PromptRecord]], sampling: SamplingParams, cfg: EvalConfig,
                  scorer, tokenizer, metrics: MetricsLogger, *, stage: int, update: int, label: str) -> float:
    """Evaluate the engine's weights on every set; returns the seconds it took (the run's ETA counts them)."""
    t0 = time.perf_counter()
    if cfg.eval_max_response_len is not None:
        sampling = replace(sampling, max_new_tokens=cfg.eval_max_response_len)
    for name, prompts in sets.items():
        if not prompts:
            continue
        greedy = replace(sampling, temperature=1.0, top_k=1, seed=0)
        groups = generate_groups(engine, prompts, greedy, 1, scorer, tokenizer, stage=stage)
        fields = {"accuracy": sum(g[0].reward for g in groups) / len(groups), "n": len(groups)}
        line = f"greedy accuracy {fields['accuracy']:.3f}"
        k = cfg.n_samples_per_eval_prompt
        if k:
            sampled = replace(sampling, temperature=cfg.eval_temperature, top_p=cfg.eval_top_p, top_k=0, seed=1)
            groups = generate_groups(engine, prompts, sampled, k, scorer, tokenizer, stage=stage)
            score = avg_at_k([[s.reward for s in g] for g in groups])
            fields.update(pass1=score.mean, pass1_std=score.std, k=k,
                          pass_at_k=sum(any(s.reward >= 1.0 for s in g) for g in groups) / len(groups))
            line += f", pass@1 {score.mean:.3f} (k = {k}, T = {cfg.eval_temperature:g})"
        metrics.log("eval", step=update, tag=f"eval/{name}", stage=stage, update=update, label=label, set=name,
                    **fields)
        print(f"[eval] {label}: {name}: {line} on {len(groups)} problems", flush=True)
    return time.perf_counter() - t0
