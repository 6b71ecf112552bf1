"""avg@k: pass@1 averaged over k sampled generations per problem (the paper's protocol, App. B "Evaluation")."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class AvgAtK:
    """Score of one benchmark: ``mean`` is pass@1 averaged over all n x k samples (in [0, 1]).

    ``round_means[j]`` is the accuracy of sample round j (the j-th sample of every problem); ``std`` is their sample
    standard deviation (ddof=1; 0 when k == 1): how much one k=1 evaluation would move from round to round.
    """

    mean: float
    std: float
    n: int
    k: int
    round_means: tuple[float, ...]


def avg_at_k(scores: Sequence[Sequence[float]]) -> AvgAtK:
    """Aggregate ``scores[i][j]`` = reward of sample j for problem i (every problem must have the same k >= 1)."""
    if not scores:
        raise ValueError("avg_at_k: no problems to aggregate")
    k = len(scores[0])
    for i, row in enumerate(scores):
        if len(row) != k or k == 0:
            raise ValueError(f"avg_at_k: problem {i} has {len(row)} samples, expected {k} (>= 1) like problem 0")
    n = len(scores)
    rounds = tuple(sum(float(row[j]) for row in scores) / n for j in range(k))
    mean = sum(rounds) / k
    std = math.sqrt(sum((r - mean) ** 2 for r in rounds) / (k - 1)) if k > 1 else 0.0
    return AvgAtK(mean=mean, std=std, n=n, k=k, round_means=rounds)
