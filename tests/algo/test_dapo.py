"""DAPO's pieces (arXiv 2503.14476) against the paper's formulas by hand and verl's reward-manager expression."""

import pytest
import torch

from megamu.algo import ALGORITHM_PRESETS, AlgoConfig
from megamu.algo.dapo import OverlongShaping, filter_values, informative_groups, overlong_penalty
from megamu.errors import ConfigError


def test_soft_overlong_punishment_eq_13_by_hand():
    # L_max = 20, L_cache = 4: free up to 16 tokens, then linear down to -1 at 20, -1 past it
    lengths = torch.tensor([1, 10, 16, 17, 18, 19, 20, 25])
    assert overlong_penalty(lengths, 20, 4).tolist() == [0, 0, 0, -0.25, -0.5, -0.75, -1.0, -1.0]
    assert overlong_penalty(lengths, 20, 4, factor=0.5).tolist() == [0, 0, 0, -0.125, -0.25, -0.375, -0.5, -0.5]


def test_overlong_penalty_matches_verls_reward_manager_within_the_limit():
    """verl/workers/reward_manager/dapo.py: min(-(len - (max_len - buffer)) / buffer * factor, 0)."""
    max_len, buffer, factor = 64, 12, 1.5
    lengths = list(range(1, max_len + 1))
    verl = [min(-(n - (max_len - buffer)) / buffer * factor, 0.0) for n in lengths]
    assert overlong_penalty(torch.tensor(lengths), max_len, buffer, factor).tolist() == pytest.approx(verl, abs=1e-15)
    shaping = OverlongShaping(max_len, buffer, factor)
    assert shaping.penalties(lengths) == pytest.approx(verl, abs=1e-15)
    assert [shaping.punished(n) for n in (52, 53)] == [False, True]
    with pytest.raises(ValueError, match="overlong buffer"):
        overlong_penalty(torch.tensor([1]), 8, 8)


def test_informative_groups_are_those_with_unequal_rewards():
    rewards = torch.tensor([[1.0, 1.0, 1.0], [0.0, 1.0, 0.0], [0.0, 0.0, 0.0], [0.5, 0.5, 0.5], [-1.0, 0.2, 0.2]])
    assert informative_groups(rewards).tolist() == [False, True, False, False, True]


def test_dapo_preset_has_the_papers_settings_and_the_paper_presets_none():
    dapo = ALGORITHM_PRESETS["dapo"]
    assert (dapo.clip_low, dapo.clip_high, dapo.aggregation) == (0.2, 0.28, "token-mean")
    assert (dapo.overlong_buffer, dapo.overlong_penalty_factor, dapo.dynamic_sampling, dapo.max_sampling_rounds) \
        == (4096, 1.0, True, 10)
    # verl-recipe dapo/run_dapo_qwen2.5_32b.sh: clip_ratio_c=10.0, filter_groups_metric=acc
    assert (dapo.clip_ratio_c, dapo.filter_metric, dapo.fill_short_stage) == (10.0, "acc", False)
    assert (dapo.use_kl_loss, dapo.entropy_coef, dapo.veto_threshold) == (False, 0.0, None)
    for name in ("mu-grpo", "grpo", "grpo-high-staleness", "grpo-relaxed", "m2po"):
        a = ALGORITHM_PRESETS[name]
        assert (a.overlong_buffer, a.dynamic_sampling) == (None, False), name


@pytest.mark.parametrize("kw, field", [({"overlong_buffer": -1}, "overlong_buffer"),
                                       ({"overlong_penalty_factor": -1.0}, "overlong_penalty_factor"),
                                       ({"max_sampling_rounds": -1}, "max_sampling_rounds"),
                                       ({"filter_metric": "seq_final_reward"}, "filter_metric"),
                                       ({"sampling_round_prompts": 0}, "sampling_round_prompts")])
def test_bad_dapo_settings_name_their_field(kw, field):
    with pytest.raises(ConfigError) as e:
        AlgoConfig.preset("grpo", **kw)
    assert e.value.field == field


def test_the_filter_metric_acc_compares_the_score_without_the_overlong_penalty():
    """verl's filter_groups.metric: acc (the reward function's correctness) vs seq_reward (score + overlong penalty).
    Group 0: both replies wrong (-1), one in the buffer: equal acc, unequal seq_reward. Group 1: one right, one wrong,
    both punished alike: unequal either way. Group 2: both right, unpunished: equal either way."""
    scores = torch.tensor([[-1.0, -1.0], [1.0, -1.0], [1.0, 1.0]], dtype=torch.float64)
    penalties = torch.tensor([[0.0, -0.3], [-0.1, -0.1], [0.0, 0.0]], dtype=torch.float64)
    rewards = scores + penalties
    assert informative_groups(filter_values(rewards, penalties, "acc")).tolist() == [False, True, False]
    assert informative_groups(filter_values(rewards, penalties, "seq_reward")).tolist() == [True, True, False]
    assert filter_values(rewards, penalties, "acc").tolist() == scores.tolist()
