import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megamu.algo import VETO_SCOPES, veto_mask

TAU = 1e-4


def keep(log_ratio, adv, mask=None, scope="sequence", tau=TAU):
    lr = torch.tensor(log_ratio, dtype=torch.float32)
    m = torch.ones_like(lr, dtype=torch.bool) if mask is None else torch.tensor(mask)
    return veto_mask(lr, torch.tensor(adv, dtype=torch.float32), m, tau, scope).tolist()


def test_appendix_d_two_token_example():
    # A < 0; token 1 is a trigger (ρ1 = r = 1e-6 < τ), token 2 has ρ2 = 1.
    lr = [[math.log(1e-6), 0.0]]
    assert keep(lr, [-1.0], scope="trigger") == [[False, True]]  # keeps the suffix token 2
    assert keep(lr, [-1.0], scope="suffix") == [[True, False]]
    assert keep(lr, [-1.0], scope="nontrigger_suffix") == [[True, False]]
    assert keep(lr, [-1.0], scope="sequence") == [[False, False]]
    assert keep(lr, [-1.0], scope="none") == [[True, True]]


def test_scopes_on_a_longer_response():
    # ρ: 1, 1e-5 (κ = 1), 0.5, 1e-6 (a second trigger), 2
    lr = [[0.0, math.log(1e-5), math.log(0.5), math.log(1e-6), math.log(2.0)]]
    assert keep(lr, [-0.5], scope="trigger") == [[True, False, True, False, True]]
    assert keep(lr, [-0.5], scope="suffix") == [[True, True, False, False, False]]
    assert keep(lr, [-0.5], scope="nontrigger_suffix") == [[True, True, False, True, False]]
    assert keep(lr, [-0.5], scope="sequence") == [[False] * 5]


def test_threshold_is_strict_and_padding_is_ignored():
    # ρ exactly τ is not a trigger; a tiny ρ at a padding position is ignored; padding is never kept.
    lr = [[math.log(TAU), 0.0, -30.0]]
    assert keep(lr, [-1.0], mask=[[True, True, False]]) == [[True, True, False]]


def test_positive_and_zero_advantages_untouched():
    lr = [[-30.0, -30.0], [-30.0, 0.0]]
    for scope in VETO_SCOPES:
        assert keep(lr, [1.0, 0.0], scope=scope) == [[True, True], [True, True]]


log_ratios = st.lists(st.floats(-50, 50, allow_nan=False), min_size=1, max_size=12)


@st.composite
def batches(draw):
    rows = draw(st.lists(log_ratios, min_size=1, max_size=5))
    width = max(len(r) for r in rows)
    lr = torch.tensor([r + [0.0] * (width - len(r)) for r in rows])
    mask = torch.tensor([[i < len(r) for i in range(width)] for r in rows])
    adv = torch.tensor(
        draw(st.lists(st.sampled_from([-1.5, -0.3, 0.0, 0.4, 2.0]), min_size=len(rows), max_size=len(rows)))
    )
    return lr, adv, mask


@settings(max_examples=150, deadline=None)
@given(batches(), st.sampled_from([1e-1, 1e-2, 1e-4, 1e-6]))
def test_properties(batch, tau):
    lr, adv, mask = batch
    k = {s: veto_mask(lr, adv, mask, tau, s) for s in VETO_SCOPES}
    dropped = {s: mask & ~k[s] for s in VETO_SCOPES}
    nonneg = adv >= 0
    for s in VETO_SCOPES:
        assert torch.equal(k[s][nonneg], mask[nonneg])  # never touches A >= 0 responses
        assert not (k[s] & ~mask).any()
    assert not dropped["none"].any()
    # nesting of the dropped sets: S_seq ⊇ S_κ ⊇ H_κ, and S_seq ⊇ T
    assert not (dropped["suffix"] & ~dropped["sequence"]).any()
    assert not (dropped["nontrigger_suffix"] & ~dropped["suffix"]).any()
    assert not (dropped["trigger"] & ~dropped["sequence"]).any()
    # lowering τ never vetoes more (trigger, suffix and sequence scopes; see test below for H_κ)
    lower = tau / 100
    for s in ("trigger", "suffix", "sequence"):
        assert not ((mask & ~veto_mask(lr, adv, mask, lower, s)) & ~dropped[s]).any()


def test_nontrigger_suffix_is_not_monotone_in_tau():
    # H_κ excludes triggers, so a token that stops being a trigger at a lower τ can become vetoed:
    # ρ = (1e-6, 5e-5): at τ=1e-4 both are triggers and H_κ drops nothing; at τ=1e-5 token 2 is a non-trigger after κ.
    lr = [[math.log(1e-6), math.log(5e-5)]]
    assert keep(lr, [-1.0], scope="nontrigger_suffix", tau=1e-4) == [[True, True]]
    assert keep(lr, [-1.0], scope="nontrigger_suffix", tau=1e-5) == [[True, False]]
