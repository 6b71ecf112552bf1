"""Issue #33, item 2: reward errors are errors; verl's and slime's reward signatures are detected and called."""

import pytest

from megamu.reward import RewardScorer
from megamu.reward.pool import RewardFunctionError
from megamu.reward.signatures import RowMeta, reward_style
from tests.reward import hooks


def test_styles_are_detected_from_the_parameter_names():
    assert reward_style(hooks.compute_score) == "verl"
    assert reward_style(hooks.custom_rm) == "slime"
    assert reward_style(hooks.crash_on_crash) == "megamu"


def test_verl_compute_score_gets_the_rows_data_source_and_extra_info():
    metas = [RowMeta("gsm8k", {"bonus": 0.5}), RowMeta("math", {}), RowMeta()]
    with RewardScorer("tests.reward.hooks:compute_score", num_workers=1, max_error_fraction=0.0) as scorer:
        got = scorer.score(["4", "4", "5"], ["4", "4", "4"], metas)
        assert scorer.style == "verl" and scorer.num_errors == 0
    # what verl's reward manager would compute: compute_score(...)["score"] per row
    want = [hooks.compute_score(m.data_source, r, t, m.extra_info)["score"]
            for r, t, m in zip(["4", "4", "5"], ["4", "4", "4"], metas)]
    assert got == want == [1.5, 1.0, 0.0]


def test_slime_custom_rm_gets_a_sample_and_may_be_async():
    with RewardScorer("tests.reward.hooks.custom_rm", num_workers=1, max_error_fraction=0.0) as scorer:
        assert scorer.score(["7", "8"], ["7", "7"], [RowMeta("ab"), RowMeta()]) == [3.0, 0.0]


def test_a_function_that_always_raises_stops_at_once_naming_it_and_a_sample():
    with RewardScorer("tests.reward.hooks:always_raises", num_workers=1, max_error_fraction=0.0) as scorer:
        with pytest.raises(RewardFunctionError) as e:
            scorer.score(["the reply"], ["42"], [RowMeta("gsm8k")])
    message = str(e.value)
    for part in ("tests.reward.hooks:always_raises", "KeyError", "'answer_field'", "'42'", "'the reply'", "gsm8k",
                 "1 of 1", "--reward-error-tolerance"):
        assert part in message, part


def test_errors_within_the_tolerance_are_counted_and_past_it_stop():
    with RewardScorer("tests.reward.hooks:crash_on_crash", num_workers=1, max_error_fraction=0.25) as scorer:
        assert scorer.score(["raise", "a", "b", "c"], ["x", "a", "b", "x"]) == [0.0, 1.0, 1.0, 0.0]
        assert scorer.num_errors == 1 and scorer.first_failure.error == "ValueError: bad"
        with pytest.raises(RewardFunctionError, match="failed on 3 of 6"):
            scorer.score(["raise", "raise"], ["x", "x"])  # 3 of 6 > 0.25
    with RewardScorer("tests.reward.hooks:crash_on_crash", num_workers=1) as counting:  # None: count, never stop
        assert counting.score(["raise"], ["x"]) == [0.0] and counting.num_errors == 1


def test_a_reward_file_path_loads_like_verls_custom_reward_function(tmp_path):
    f = tmp_path / "my_reward.py"
    f.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                 "    return float(solution_str.strip() == ground_truth)\n")
    with RewardScorer(f"{f}:compute_score", num_workers=1, max_error_fraction=0.0) as scorer:
        assert scorer.score([" 3", "4"], ["3", "3"]) == [1.0, 0.0]
