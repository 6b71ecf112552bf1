"""The lab's intervals (issue 51): Student t quantiles against closed forms, paired-seed t intervals against hand
arithmetic, and round three's registered headline rule on made-up runs."""

from __future__ import annotations

import math
import statistics

import pytest

from bench.lab import plan
from bench.lab import round3 as r3
from bench.lab import stats as st
from bench.lab.summary import Run


@pytest.mark.parametrize("p", [0.6, 0.9, 0.95, 0.975, 0.995])
def test_t_quantiles_match_the_closed_forms_of_one_and_two_degrees_of_freedom(p):
    assert st.t_quantile(p, 1) == pytest.approx(math.tan(math.pi * (p - 0.5)), rel=1e-9)  # Cauchy
    assert st.t_quantile(p, 2) == pytest.approx((2 * p - 1) / math.sqrt(2 * p * (1 - p)), rel=1e-9)
    assert st.t_quantile(1 - p, 3) == pytest.approx(-st.t_quantile(p, 3), rel=1e-12)


def test_t_cdf_of_three_degrees_of_freedom_and_the_normal_limit():
    # df 3 has a closed form: 1/2 + (1/π) (x/(sqrt(3)(1 + x²/3)) + atan(x/sqrt(3)))
    for x in (0.3, 1.0, 2.353, 5.0):
        closed = 0.5 + (x / (math.sqrt(3) * (1 + x * x / 3)) + math.atan(x / math.sqrt(3))) / math.pi
        assert st.t_cdf(x, 3) == pytest.approx(closed, rel=1e-12)
    # many degrees of freedom: the normal distribution (t_cdf - Φ is O(1/df))
    for x in (0.5, 1.645, 3.0):
        assert abs(st.t_cdf(x, 400) - statistics.NormalDist().cdf(x)) < 1e-3
    # every odd and even branch increases with x and ends at 1
    for df in range(1, 12):
        vals = [st.t_cdf(x, df) for x in (-4, -1, 0, 1, 4, 1e6)]
        assert vals == sorted(vals) and vals[2] == 0.5 and vals[-1] == pytest.approx(1, abs=1e-5)


def test_a_paired_interval_is_the_mean_plus_minus_t_sd_over_sqrt_n():
    iv = st.Interval((0.04, 0.10, -0.02, 0.06), 0.90)
    sd = statistics.stdev(iv.ds)
    half = st.t_quantile(0.95, 3) * sd / 2
    assert iv.mean == pytest.approx(0.045) and iv.half_width == pytest.approx(half, rel=1e-12)
    assert iv.against() == "inconclusive" and iv.against(-0.03) == "above"
    one = st.Interval((0.2,), 0.95)
    assert one.half_width == math.inf and one.against() == "inconclusive" and one.seeds_to_decide() is None
    # two seeds at +0.039 and +0.100 (round two's lr 1e-5 arm): t(1, 0.975) = 12.706 makes it inconclusive
    two = st.Interval((0.039, 0.100), 0.95)
    assert two.half_width == pytest.approx(12.7062 * statistics.stdev((0.039, 0.100)) / math.sqrt(2), rel=1e-4)
    assert two.against() == "inconclusive"
    need = two.seeds_to_decide()
    assert need is not None and st.Interval((0.039, 0.100) * (need // 2 + 1), 0.95).against() == "above"


def _run(method: str, seed: int, last: float, mu: int, lr: float = 1e-5, every: int = 128) -> Run:
    evals = [{"update": u, "sampled": last if u > 3072 else 0.3, "greedy": 0.3, "n": 128, "k": 4, "time": u / 4}
             for u in range(0, 4097, every)]
    config = {"method": method, "mu": mu, "stages": 4096 // mu, "seed": seed, "lr": lr, "updates": 4096,
              "prompts_per_update": 2, "eval_every": every, "k": 4}
    return Run({"key": f"{method}/{mu}/s{seed}", "config": config, "evals": evals, "train_s": 1000.0})


def test_the_headline_rule_reads_matches_does_not_match_and_inconclusive():
    a = [_run("grpo", s, 0.80, 4) for s in (1, 2, 3, 4)]
    close = [_run("mu-grpo", s, 0.80 + d, 1024) for s, d in zip((1, 2, 3, 4), (0.01, -0.01, 0.0, 0.005))]
    far = [_run("mu-grpo", s, 0.80 + d, 1024) for s, d in zip((1, 2, 3, 4), (-0.10, -0.12, -0.09, -0.11))]
    wide = [_run("mu-grpo", s, 0.80 + d, 1024) for s, d in zip((1, 2, 3, 4), (0.10, -0.15, 0.05, -0.12))]
    assert r3.headline(a, close)[1] == "matches"
    assert r3.headline(a, far)[1] == "does not match"
    iv, verdict = r3.headline(a, wide)
    assert verdict.startswith("inconclusive") and iv.lo < plan.HEADLINE_MARGIN < iv.hi
    assert r3.headline(a, close[:1])[1] == "inconclusive (fewer than two paired seeds)"


def test_round_three_arms_take_b_seeds_one_and_two_from_round_two_and_time_to_ninety_percent():
    old = [_run("mu-grpo", s, 0.75, 1024, every=256) for s in (1, 2)]
    new = [_run("mu-grpo", s, 0.75, 1024) for s in (3, 4)]
    a = [_run("grpo", s, 0.80, 4) for s in (1, 2, 3, 4)]
    g = r3.arms(old + new + a + [_run("mu-grpo", 1, 0.7, 64)])
    assert [r.seed for r in g["B"]] == [1, 2, 3, 4] and len(g["A"]) == 4 and len(g["E64"]) == 1
    rows = r3.time_ratios(a, g["B"])
    # the target is 90 % of A's 0.80 = 0.72; every run passes it first after update 3072: at 3200 (t = 800) when
    # evaluated every 128 updates, at 3328 (t = 832) every 256 (the spacing, not the method, makes that 1.04)
    assert "| 3 | 0.720 | 800 | 800 | 1.00 | 1.00 |" in rows
    assert "| 1 (B from round two: another sitting) | 0.720 | 800 | 832 | 1.04 | 1.00 |" in rows
