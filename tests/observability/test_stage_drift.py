"""A stage's drift record (megamu/observability/drift.py) against hand-computed values, and its hint's threshold."""

import math

from megamu.observability.drift import HINT_KL, StageDrift


def test_median_max_and_mean_veto_by_hand():
    d = StageDrift.of([0.04, 0.01, 0.02, 0.10], [0.0, 0.02, 0.0, 0.06])
    assert d.updates == 4
    assert math.isclose(d.kl_median, (0.02 + 0.04) / 2)  # an even count: the mean of the two middle values
    assert d.kl_max == 0.10
    assert math.isclose(d.veto_token_fraction, 0.08 / 4)
    assert d.record() == {"drift_updates": 4, "approx_kl_median": d.kl_median, "approx_kl_max": 0.10,
                          "veto_token_fraction_mean": d.veto_token_fraction}
    assert d.line() == "drift: KL median 0.0300 (max 0.1000), veto 2.00% of tokens"


def test_updates_without_tokens_are_left_out():
    d = StageDrift.of([float("nan"), 0.005, 0.007], [0.5, 0.0, 0.01])
    assert (d.updates, d.kl_median, d.kl_max, d.veto_token_fraction) == (2, 0.006, 0.007, 0.005)
    assert StageDrift.of([float("nan")], [0.0]) is None


def test_the_hint_is_for_a_drifting_stage_after_the_first():
    far = StageDrift.of([2 * HINT_KL] * 3, [0.0] * 3)
    near = StageDrift.of([HINT_KL] * 3, [0.0] * 3)  # at the threshold: no hint
    assert far.hint(0) is None  # the first stage moves a base model furthest (Table 5's stage 0)
    assert "--prompts-per-update" in far.hint(1) and "--lr" in far.hint(1) and "[stage 1]" in far.hint(1)
    assert near.hint(2) is None
