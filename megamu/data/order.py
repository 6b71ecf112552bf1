"""The one shuffled order the run draws from: epochs of seeded permutations of range(n), chained end to end.

Stage prompts (``megamu.data.stage_prompts``) and each stage's minibatches (``megamu.rollout.dataset``) both take
consecutive slices of such a stream, so every item is used once per epoch and any slice is a pure function of its
position: a resumed run draws exactly what an uninterrupted one would.
"""

from __future__ import annotations

import random


def epoch_permutation(n: int, seed: int | str, epoch: int) -> list[int]:
    order = list(range(n))
    random.Random(f"{seed}/{epoch}").shuffle(order)
    return order


def epoch_stream(n: int, seed: int | str, start: int, count: int) -> list[int]:
    """Positions start .. start + count - 1 of the stream (each epoch reshuffled)."""
    if n <= 0:
        raise ValueError(f"epoch_stream needs n > 0, got {n}")
    orders: dict[int, list[int]] = {}
    out = []
    for pos in range(start, start + count):
        epoch, i = divmod(pos, n)
        if epoch not in orders:
            orders[epoch] = epoch_permutation(n, seed, epoch)
        out.append(orders[epoch][i])
    return out
