"""Padding of the update's micro-batches (``pad_fraction``: padded / read positions), in minibatch order and in the
length order ``train_step`` uses, on the CPU demo's shape and on a synthetic minibatch with a 3k-token tail.

    python bench/pad_fraction.py

The tailed minibatch is the paper's update shape (32 prompts x 8 samples, responses up to 3072 tokens): prompts of
60-250 tokens, each prompt's responses log-normal around a per-prompt median of 300-1500 tokens (sigma 0.6), cut at
3072. Shown for token budgets of 8k-32k per micro-batch with one row per sample (the GPU layout), and for the demo's
micro-batches of 8 with shared-prompt rows (the CPU layout: a micro-batch of 8 is one group, one row, no padding).
Pure arithmetic on lengths: no model runs.
"""

from __future__ import annotations

import math
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megamu.rollout.records import RolloutSample  # noqa: E402
from megamu.training.batch import row_lengths, split_micro_batches  # noqa: E402
from megamu.training.step import length_order  # noqa: E402


def tailed(seed: int, groups: int = 32, group: int = 8, max_len: int = 3072) -> list[RolloutSample]:
    rng = random.Random(seed)
    out = []
    for g in range(groups):
        p, median = rng.randint(60, 250), rng.choice([300, 600, 1000, 1500])
        for j in range(group):
            r = min(max_len, max(8, int(rng.lognormvariate(math.log(median), 0.6))))
            out.append(RolloutSample(g, j, [1] * p, [2] * r, [0.0] * r, 0.0, 1.0, "stop"))
    return out


def demo(seed: int) -> list[RolloutSample]:
    """The demo's update: 4 groups x 8 of a ~97-token prompt (few-shot), replies of 8-64 tokens (64: truncated)."""
    rng = random.Random(seed)
    out = []
    for g in range(4):
        prompt = [1] * rng.randint(94, 100)
        for j in range(8):
            r = rng.randint(8, 64)
            out.append(RolloutSample(g, j, prompt, [2] * r, [0.0] * r, 0.0, 1.0, "stop"))
    return out


def pad_fraction(samples, micro_batch_size: int, budget: int | None, share: bool, sort: bool) -> tuple[float, int]:
    if sort:
        samples = [samples[i] for i in length_order(samples, share)]
    mbs = split_micro_batches(samples, micro_batch_size, budget, share)
    read = sum(len(row_lengths(m, share)) * max(row_lengths(m, share)) for m in mbs)
    real = sum(sum(row_lengths(m, share)) for m in mbs)
    return 1 - real / read, len(mbs)


def main() -> None:
    print(f"{'minibatch':<22} {'layout':<14} {'budget':>7} {'minibatch order':>17} {'length order':>14}")
    for seed in range(3):
        s = tailed(seed)
        for budget in (8192, 16384, 32768):
            (a, na), (b, nb) = (pad_fraction(s, 10**6, budget, False, sort) for sort in (False, True))
            print(f"{'3k-tailed, seed ' + str(seed):<22} {'row per sample':<14} {budget:>7} {a:>10.3f} ({na:>3} mb)"
                  f" {b:>7.3f} ({nb:>3} mb)")
    for share in (True, False):
        (a, na), (b, nb) = (pad_fraction(demo(0), 8, None, share, sort) for sort in (False, True))
        layout = "shared prompt" if share else "row per sample"
        print(f"{'demo (4 x 8)':<22} {layout:<14} {'8 smp':>7} {a:>10.3f} ({na:>3} mb) {b:>7.3f} ({nb:>3} mb)")


if __name__ == "__main__":
    main()
