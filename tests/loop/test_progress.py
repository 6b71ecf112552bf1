"""The update progress bar never prints nan: an update with nothing to learn from says so (issue 49, item 8)."""

from megamu.loop.trainer import update_postfix

TRAINED = {"loss": -0.0123, "reward_mean": 0.5, "ratio_mean": 1.0004, "veto_token_fraction": 0.0,
           "advantage_min": -1.2, "advantage_max": 0.9}


def test_a_trained_update_shows_its_numbers():
    assert update_postfix(TRAINED) == "loss=-0.0123, reward=0.50, ratio=1.000, veto=0.000"


def test_an_update_whose_groups_all_have_zero_advantage_says_so_without_nan():
    # what train_step records when --skip-zero-advantage left no token to score: ratio and veto are NaN
    stats = {**TRAINED, "loss": 0.0, "reward_mean": 1.0, "ratio_mean": float("nan"),
             "veto_token_fraction": float("nan"), "advantage_min": 0.0, "advantage_max": 0.0}
    shown = update_postfix(stats)
    assert "nan" not in shown
    assert shown == "loss=0.0000, reward=1.00, ratio=–, veto=–: nothing to learn (every group's rewards equal)"
