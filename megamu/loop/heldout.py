"""Held-out greedy accuracy: the number a run reports before its first update and after its last (rank 0)."""

from __future__ import annotations

import time
from dataclasses import replace

from megamu.data.prompts import PromptRecord
from megamu.engines import Engine
from megamu.engines.types import SamplingParams
from megamu.metrics import MetricsLogger
from megamu.rollout.phase import generate_groups


def evaluate_held_out(engine: Engine, prompts: list[PromptRecord], sampling: SamplingParams, scorer, tokenizer,
                      metrics: MetricsLogger, *, stage: int, label: str) -> tuple[float, float]:
    """(accuracy, seconds): one greedy sample per held-out prompt (top-k 1 of the T = 1 distribution), scored by the
    run's reward; logged as an "eval" record."""
    greedy = replace(sampling, temperature=1.0, top_k=1, seed=0)
    t0 = time.perf_counter()
    groups = generate_groups(engine, prompts, greedy, 1, scorer, tokenizer, stage=stage)
    seconds = time.perf_counter() - t0
    acc = sum(g[0].reward for g in groups) / max(len(groups), 1)
    metrics.log("eval", stage=stage, label=label, accuracy=acc, n=len(groups))
    print(f"[eval] {label}: greedy accuracy {acc:.3f} on {len(groups)} held-out prompts", flush=True)
    return acc, seconds
