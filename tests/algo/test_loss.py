import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megamu.algo import ALGORITHM_PRESETS, AlgoConfig, m2po_mask, policy_loss
from megamu.errors import ConfigError

# Two responses: A = +1 with ρ = (1.5, 0.9); A = -1 with ρ = (0.5, 1.1) only its first token a response token.
LOG_RATIO = torch.log(torch.tensor([[1.5, 0.9], [0.5, 1.1]]))
ADV = torch.tensor([1.0, -1.0])
MASK = torch.tensor([[True, True], [True, False]])


def run(log_ratio=LOG_RATIO, adv=ADV, mask=MASK, algo: AlgoConfig | None = None, **kw):
    logp = log_ratio.clone().requires_grad_(True)
    loss, stats = policy_loss(logp, torch.zeros_like(logp), adv, mask, algo or AlgoConfig.preset("grpo", **kw))
    loss.backward()
    return loss.item(), stats, logp.grad


@pytest.mark.parametrize(
    "aggregation, expected",
    [
        # GRPO ε=0.2, per-token −min(ρA, clip(ρ)A): seq0 (−1.2, −0.9), seq1 (+0.8)
        ("seq-mean-token-mean", (-1.05 + 0.8) / 2),
        ("token-mean", (-1.2 - 0.9 + 0.8) / 3),
        ("seq-mean-token-sum", (-2.1 + 0.8) / 2),
    ],
)
def test_grpo_hand_values(aggregation, expected):
    loss, stats, _ = run(clip_low=0.2, clip_high=0.2, aggregation=aggregation)
    assert loss == pytest.approx(expected, abs=1e-6)
    assert stats["clip_fraction"] == pytest.approx(2 / 3)  # 1.5 > 1.2 with A>0, 0.5 < 0.8 with A<0
    assert stats["ratio_mean"] == pytest.approx((1.5 + 0.9 + 0.5) / 3, rel=1e-6)
    assert stats["ratio_neg_adv_mean"] == pytest.approx(0.5, rel=1e-6)
    assert stats["log_ratio_min"] == pytest.approx(math.log(0.5), rel=1e-6)
    kl = sum(r - 1 - math.log(r) for r in (1.5, 0.9, 0.5)) / 3
    assert stats["approx_kl"] == pytest.approx(kl, rel=1e-5)


def test_mu_grpo_hand_values():
    loss, stats, _ = run(algo=AlgoConfig.preset("mu-grpo"))
    # range [0, 5]: nothing clipped; seq0 −(1.5 + 0.9)/2, seq1 +0.5
    assert loss == pytest.approx((-1.2 + 0.5) / 2, abs=1e-6)
    assert stats["clip_fraction"] == 0.0 and stats["veto_token_fraction"] == 0.0


def test_section_3_2_gradient_of_negative_advantage_tokens():
    # Under clip [0, 5], an A<0 token with ρ in range has ∂loss/∂logπ = |A|·ρ (one token, so aggregation weight 1).
    cfg = AlgoConfig.preset("grpo-relaxed")
    for rho in (1e-3, 0.3, 1.0, 2.5, 4.9):
        _, _, g = run(torch.tensor([[math.log(rho)]]), torch.tensor([-0.7]), torch.tensor([[True]]), algo=cfg)
        assert g.item() == pytest.approx(0.7 * rho, rel=1e-5)
    # outside the range: an A>0 token above 5 is clipped, zero gradient; inside it gets −A·ρ
    _, stats, g = run(torch.tensor([[math.log(6.0)]]), torch.tensor([0.7]), torch.tensor([[True]]), algo=cfg)
    assert g.item() == 0.0 and stats["clip_fraction"] == 1.0
    _, _, g = run(torch.tensor([[math.log(4.0)]]), torch.tensor([0.7]), torch.tensor([[True]]), algo=cfg)
    assert g.item() == pytest.approx(-0.7 * 4.0, rel=1e-5)
    # with GRPO's ε = 0.2 an A<0 token below 0.8 is clipped: zero gradient
    _, _, g = run(
        torch.tensor([[math.log(0.5)]]), torch.tensor([-0.7]), torch.tensor([[True]]), clip_low=0.2, clip_high=0.2
    )
    assert g.item() == 0.0


def test_veto_zeroes_terms_but_keeps_denominators():
    lr = torch.tensor([[0.0, math.log(1e-5), 0.0], [math.log(2.0), 0.0, 0.0]])
    adv = torch.tensor([-1.0, 1.0])
    mask = torch.ones(2, 3, dtype=torch.bool)
    loss, stats, g = run(lr, adv, mask, algo=AlgoConfig.preset("mu-grpo"))
    assert torch.equal(g[0], torch.zeros(3))  # the whole A<0 response is vetoed (sequence scope)
    # seq1: −(2 + 1 + 1)/3, seq0 contributes 0, mean over both sequences
    assert loss == pytest.approx(-(4.0 / 3) / 2, rel=1e-6)
    assert stats["veto_token_fraction"] == pytest.approx(0.5)
    assert stats["veto_sequence_fraction"] == pytest.approx(0.5)
    # trigger scope only drops the trigger token
    _, stats, g = run(lr, adv, mask, algo=AlgoConfig.preset("mu-grpo").with_overrides(veto_scope="trigger"))
    assert g[0, 1] == 0.0 and g[0, 0] != 0.0 and g[0, 2] != 0.0
    assert stats["veto_token_fraction"] == pytest.approx(1 / 6)


def test_m2po_mask_hand_example():
    # (log ρ)² = .01, .04, .25, 0 -> mean .075 > .04; dropping the .25 leaves mean .05/3 = .0167 <= .04
    lr = torch.tensor([[0.1, 0.2, 0.5, 0.0]])
    kept = m2po_mask(lr, torch.ones(1, 4, dtype=torch.bool), 0.04)
    assert kept.tolist() == [[True, True, False, True]]
    _, stats, g = run(lr, torch.tensor([1.0]), torch.ones(1, 4, dtype=torch.bool), algo=AlgoConfig.preset("m2po"))
    assert stats["m2po_mask_fraction"] == pytest.approx(0.25)
    assert g[0, 2] == 0.0 and g[0, 0] != 0.0
    # already inside the trust region: nothing masked
    assert m2po_mask(lr * 0.1, torch.ones(1, 4, dtype=torch.bool), 0.04).all()


def test_bad_config_names_the_field_not_a_flag():
    # The algorithm package knows no command line: errors name the config field (arguments.py maps it to a flag).
    with pytest.raises(ConfigError, match="veto_scope") as err:
        AlgoConfig.preset("grpo", veto_scope="prefix")
    assert err.value.field == "veto_scope" and "--" not in str(err.value)
    with pytest.raises(ConfigError, match="name"):
        AlgoConfig.preset("ppo")
    with pytest.raises(ConfigError, match="aggregation"):
        AlgoConfig.preset("grpo", aggregation="sum")


@st.composite
def batches(draw, low=-50.0, high=50.0):
    b = draw(st.integers(1, 4))
    lengths = draw(st.lists(st.integers(1, 6), min_size=b, max_size=b))
    t = max(lengths)
    lr = torch.tensor(draw(st.lists(st.floats(low, high, allow_nan=False), min_size=b * t, max_size=b * t))).view(b, t)
    adv = torch.tensor(draw(st.lists(st.floats(-3, 3, allow_nan=False), min_size=b, max_size=b)))
    mask = torch.tensor([[i < n for i in range(t)] for n in lengths])
    return lr, adv, mask


@settings(max_examples=60, deadline=None)
@given(batches(low=0.0, high=0.0), st.sampled_from(sorted(ALGORITHM_PRESETS)))
def test_on_policy_gradient_is_reinforce(batch, preset):
    # ρ ≡ 1: ∂loss/∂logπ_{i,t} = −A_i / (|B| T_i) for seq-mean-token-mean, −A_i / Σ_i T_i for token-mean (DAPO's):
    # the REINFORCE gradient with group advantages.
    _, adv, mask = batch
    algo = AlgoConfig.preset(preset)
    _, _, g = run(torch.zeros(mask.shape), adv, mask, algo=algo)
    per_token = mask.sum() if algo.aggregation == "token-mean" else mask.shape[0] * mask.sum(1, keepdim=True)
    expected = -adv.view(-1, 1) / per_token * mask
    assert torch.allclose(g, expected, atol=1e-7)


@settings(max_examples=60, deadline=None)
@given(
    batches(),
    st.sampled_from(sorted(ALGORITHM_PRESETS)),
    st.sampled_from(["seq-mean-token-mean", "token-mean", "seq-mean-token-sum"]),
)
def test_finite_for_extreme_log_ratios(batch, preset, aggregation):
    lr, adv, mask = batch
    cfg = AlgoConfig.preset(preset).with_overrides(aggregation=aggregation)
    loss, stats, g = run(lr, adv, mask, algo=cfg)
    assert math.isfinite(loss) and torch.isfinite(g).all()
    assert all(math.isfinite(v) for k, v in stats.items() if k != "ratio_neg_adv_mean")


def test_dual_clip_hand_values():
    """Dual-clip (arXiv 1912.09729; verl verl/trainer/ppo/core_algos.py:1147-1153 at b178a3c, clip_ratio_c; slime
    slime/utils/ppo_utils.py:138-144 at 624b824, --eps-clip-c): for A < 0 the loss is min(c·|A|, max(−ρA, −clip(ρ)A));
    A > 0 unchanged.
    c = 3, ε = 0.2/0.28, one token per response: ρ, A -> loss, ∂loss/∂logπ
      ρ = 5.0, A = -1: max(5, 1.2·1) = 5 > 3 -> 3, gradient 0 (without dual-clip: 5, gradient 5)
      ρ = 2.0, A = -1: max(2, 1.2) = 2 < 3 -> 2, gradient 2
      ρ = 0.5, A = -1: max(0.5, 0.8) = 0.8 (clipped below) -> 0.8, gradient 0
      ρ = 5.0, A = +1: max(-5, -1.28) = -1.28 -> -1.28, gradient 0 (dual-clip acts on A < 0 only)"""
    log_ratio = torch.log(torch.tensor([[5.0], [2.0], [0.5], [5.0]], dtype=torch.float64))
    adv = torch.tensor([-1.0, -1.0, -1.0, 1.0], dtype=torch.float64)
    mask = torch.ones(4, 1, dtype=torch.bool)
    algo = AlgoConfig.preset("grpo", clip_high=0.28, clip_ratio_c=3.0, aggregation="seq-mean-token-sum")
    loss, stats, grad = run(log_ratio, adv, mask, algo=algo)
    assert loss == pytest.approx((3.0 + 2.0 + 0.8 - 1.28) / 4, abs=1e-12)
    assert grad.flatten().tolist() == pytest.approx([0.0, 2.0 / 4, 0.0, 0.0], abs=1e-12)
    assert stats["dual_clip_fraction"] == pytest.approx(1 / 4)
    off, off_stats, off_grad = run(log_ratio, adv, mask, algo=AlgoConfig.preset(
        "grpo", clip_high=0.28, aggregation="seq-mean-token-sum"))
    assert off == pytest.approx((5.0 + 2.0 + 0.8 - 1.28) / 4, abs=1e-12) and off_grad[0, 0] == pytest.approx(5 / 4)
    assert off_stats["dual_clip_fraction"] == 0.0
    with pytest.raises(ConfigError, match="clip_ratio_c"):
        AlgoConfig.preset("grpo", clip_ratio_c=1.0)
