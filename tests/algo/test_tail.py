"""megamu.algo.tail against plain-Python / numpy references on random batches with padding and mixed advantages."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from megamu.algo import REFERENCE_TAU, lower_tail_stats, neg_adv_log_ratios


def _batch(seed: int, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    b, t = 7, 9
    logp = -torch.rand(b, t, generator=g, dtype=torch.float64).to(dtype) * 3
    behaviour = logp.double() + torch.randn(b, t, generator=g, dtype=torch.float64) * 4  # wide: some ρ < 1e-4
    lengths = torch.randint(0, t + 1, (b,), generator=g)
    mask = torch.arange(t)[None, :] < lengths[:, None]
    adv = torch.tensor([-1.0, 0.5, -0.3, 0.0, -2.0, 1.0, -0.7])
    return logp, behaviour.to(dtype), adv, mask


@pytest.mark.parametrize("seed", range(4))
def test_tail_matches_a_row_by_row_reference(seed):
    logp, behaviour, adv, mask = _batch(seed)
    tokens, reply_min = neg_adv_log_ratios(logp, behaviour, adv, mask)
    ref_tokens, ref_min = [], []
    for i in range(len(adv)):
        row = [float(logp[i, j]) - float(behaviour[i, j]) for j in range(mask.shape[1]) if mask[i, j]]
        if adv[i] < 0 and row:
            ref_tokens += row
            ref_min.append(min(row))
    assert tokens.dtype == reply_min.dtype == torch.float64
    # float64 differences of float32 inputs are exact, so equality holds
    assert tokens.tolist() == ref_tokens and reply_min.tolist() == ref_min
    stats = lower_tail_stats(tokens, reply_min, tau=1e-4)
    assert stats["neg_adv_log_ratio_p10"] == pytest.approx(float(np.quantile(ref_tokens, 0.1)), rel=1e-12)
    assert stats["neg_adv_reply_below_tau"] == sum(m < math.log(1e-4) for m in ref_min) / len(ref_min)


def test_no_negative_advantage_gives_nan_and_reference_tau_is_mu_grpos():
    logp, behaviour, _, mask = _batch(0)
    tokens, reply_min = neg_adv_log_ratios(logp, behaviour, torch.ones(7), mask)
    assert tokens.numel() == reply_min.numel() == 0
    assert all(math.isnan(v) for v in lower_tail_stats(tokens, reply_min, 1e-4).values())
    assert REFERENCE_TAU == 1e-4  # App. B's τ


def test_the_trigger_fraction_counts_replies_not_tokens():
    # two A < 0 replies: one with three tokens below log τ, one with none; one A > 0 reply far below (ignored)
    logp = torch.tensor([[-20.0, -20.0, -20.0], [-1.0, -1.0, -1.0], [-30.0, -30.0, -30.0]])
    behaviour = torch.full((3, 3), -1.0)
    mask = torch.ones(3, 3, dtype=torch.bool)
    stats = lower_tail_stats(*neg_adv_log_ratios(logp, behaviour, torch.tensor([-1.0, -1.0, 1.0]), mask), 1e-4)
    assert stats["neg_adv_reply_below_tau"] == 0.5
