"""The KL and entropy terms (megamu.algo.kl, policy_loss's ref_logp / entropy) against hand computations of
Schulman's estimators and of the loss slime and verl form: pg + kl_coef x agg(kl) − entropy_coef x agg(entropy)."""

import math

import pytest
import torch

from megamu.algo import ALGORITHM_PRESETS, AlgoConfig, policy_loss
from megamu.algo.kl import KL_TYPES, kl_estimate
from megamu.errors import ConfigError

LN2 = math.log(2.0)


@pytest.mark.parametrize("kind, at_two, at_half", [
    # log r = log π_θ − log π_ref = ln 2 and ln 1/2
    ("k1", LN2, -LN2),
    ("k2", LN2**2 / 2, LN2**2 / 2),
    ("k3", 0.5 - 1 + LN2, 2 - 1 - LN2),  # 1/r − 1 + log r
    ("low_var_kl", 0.5 - 1 + LN2, 2 - 1 - LN2),
])
def test_estimators_hand_values(kind, at_two, at_half):
    logp = torch.tensor([LN2, -LN2], dtype=torch.float64)
    kl = kl_estimate(logp, torch.zeros_like(logp), kind)
    assert kl.tolist() == pytest.approx([at_two, at_half], rel=1e-12)


def test_low_var_kl_is_k3_clamped_to_ten():
    logp = torch.tensor([-20.0, 20.0], dtype=torch.float64)  # k3 = e^20 − 21 and e^-20 − 1 + 20
    ref = torch.zeros_like(logp)
    assert kl_estimate(logp, ref, "k3").tolist() == pytest.approx([math.exp(20) - 21, math.exp(-20) + 19], rel=1e-12)
    assert kl_estimate(logp, ref, "low_var_kl").tolist() == [10.0, 10.0]


def test_k3_is_unbiased_for_the_kl_on_the_policys_samples():
    """E_{a~π}[k3] and E_{a~π}[k1] = KL(π ‖ π_ref), computed exactly over a 3-token vocabulary."""
    pi = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
    ref = torch.tensor([0.2, 0.5, 0.3], dtype=torch.float64)
    exact = float((pi * (pi / ref).log()).sum())
    for kind in ("k1", "k3"):
        assert float((pi * kl_estimate(pi.log(), ref.log(), kind)).sum()) == pytest.approx(exact, rel=1e-12)


# Two responses: A = +1 with ρ = (1.5, 0.9); A = −1 with ρ = (0.5, 1.1), only its first token a response token.
LOGP = torch.log(torch.tensor([[1.5, 0.9], [0.5, 1.1]], dtype=torch.float64))
BEHAVIOUR = torch.zeros_like(LOGP)
ADV = torch.tensor([1.0, -1.0], dtype=torch.float64)
MASK = torch.tensor([[True, True], [True, False]])
REF = torch.log(torch.tensor([[1.0, 1.8], [0.25, 7.0]], dtype=torch.float64))  # log r = (ln 1.5, −ln 2, ln 2, ·)
ENTROPY = torch.tensor([[0.7, 1.3], [2.0, 9.0]], dtype=torch.float64)


def loss_of(algo, ref=None, entropy=None):
    logp = LOGP.clone().requires_grad_(True)
    ent = None if entropy is None else entropy.clone().requires_grad_(True)
    loss, stats = policy_loss(logp, BEHAVIOUR, ADV, MASK, algo, ref_logp=ref, entropy=ent)
    loss.backward()
    return loss.item(), stats, logp.grad, None if ent is None else ent.grad


def test_kl_and_entropy_terms_hand_computed_token_mean():
    grpo = ALGORITHM_PRESETS["grpo"].with_overrides(aggregation="token-mean")
    algo = grpo.with_overrides(use_kl_loss=True, kl_coef=0.1, kl_type="k3", entropy_coef=0.01)
    # GRPO ε = 0.2: per token −min(ρA, clip(ρ)A) = (−1.2, −0.9, +0.8), token mean over 3 tokens
    pg = (-1.2 - 0.9 + 0.8) / 3
    k3 = [1 / 1.5 - 1 + math.log(1.5), 2 - 1 - LN2, 0.5 - 1 + LN2]
    kl = sum(k3) / 3
    ent = (0.7 + 1.3 + 2.0) / 3
    loss, stats, grad, ent_grad = loss_of(algo, REF, ENTROPY)
    assert loss == pytest.approx(pg + 0.1 * kl - 0.01 * ent, rel=1e-12)
    assert (stats["pg_loss"], stats["kl_loss"], stats["entropy_loss"]) == pytest.approx((pg, kl, ent), rel=1e-12)
    # ∂k3/∂logp = 1 − 1/r; ∂pg/∂logp = −ρA where the clip is inactive: ρ = 1.5 (A > 0) and ρ = 0.5 (A < 0) sit on
    # the clipped branch (constants 1.2 A, 0.8 A), ρ = 0.9 does not
    pg_grad = [[0.0, -0.9], [0.0, 0.0]]
    kl_grad = [[1 - 1 / 1.5, 1 - 2.0], [1 - 0.5, 0.0]]
    expected = [[(pg_grad[i][j] + 0.1 * kl_grad[i][j]) / 3 if MASK[i, j] else 0.0 for j in range(2)] for i in range(2)]
    assert grad.tolist() == [pytest.approx(row, rel=1e-12, abs=1e-15) for row in expected]
    assert ent_grad.tolist() == [[-0.01 / 3, -0.01 / 3], [-0.01 / 3, 0.0]]


def test_kl_term_seq_mean_token_mean():
    algo = AlgoConfig.preset("grpo", use_kl_loss=True, kl_coef=0.5, kl_type="k1")
    per_seq = [(math.log(1.5) - LN2) / 2, LN2]  # k1 = log r, mean over each reply's tokens
    loss, stats, _, _ = loss_of(algo, REF)
    assert stats["kl_loss"] == pytest.approx(sum(per_seq) / 2, rel=1e-12)
    assert loss == pytest.approx(stats["pg_loss"] + 0.5 * sum(per_seq) / 2, rel=1e-12)


@pytest.mark.parametrize("preset", sorted(ALGORITHM_PRESETS))
def test_terms_at_zero_leave_the_loss_and_gradient_unchanged(preset):
    base = ALGORITHM_PRESETS[preset]
    today, _, grad, _ = loss_of(base)
    zeroed = base.with_overrides(use_kl_loss=True, kl_coef=0.0, entropy_coef=0.0)
    loss, stats, grad_zero, ent_grad = loss_of(zeroed, REF, ENTROPY)
    assert loss == today and torch.equal(grad, grad_zero)
    assert "kl_loss" in stats and ent_grad is None  # at 0 the entropy is a metric: not in the graph


def test_paper_presets_have_no_kl_and_no_entropy():
    for algo in ALGORITHM_PRESETS.values():
        assert (algo.use_kl_loss, algo.kl_coef, algo.entropy_coef, algo.uses_reference) == (False, 0.0, 0.0, False)
    assert sorted(KL_TYPES) == ["k1", "k2", "k3", "low_var_kl"]


def test_missing_inputs_and_bad_settings_are_named():
    with pytest.raises(ValueError, match="ref_logp"):
        loss_of(AlgoConfig.preset("grpo", use_kl_loss=True, kl_coef=0.1))
    with pytest.raises(ValueError, match="entropy"):
        loss_of(AlgoConfig.preset("grpo", entropy_coef=0.1))
    for kw, field in (({"kl_coef": 0.1}, "kl_coef"), ({"kl_type": "k4"}, "kl_type"),
                      ({"use_kl_loss": True, "kl_coef": -1.0}, "kl_coef"),
                      ({"entropy_coef": math.nan}, "entropy_coef")):
        with pytest.raises(ConfigError) as e:
            AlgoConfig.preset("grpo", **kw)
        assert e.value.field == field
