import os
import time

import pytest

from megamu.reward import RewardScorer, load_reward_fn, math_score, score_batch
from tests.processes import pid_alive


def test_load_reward_fn():
    assert load_reward_fn("megamu.reward.math:math_score") is math_score
    for bad, msg in [("nocolon", "module:function"), ("no_such_mod_xyz:f", "cannot import"),
                     ("megamu.reward.math:nope", "no callable")]:
        with pytest.raises(ValueError, match=msg):
            load_reward_fn(bad)


def test_hung_worker_is_replaced_and_scores_zero():
    with RewardScorer("tests.reward.hooks:hang_on_hang", timeout_s=1.0, num_workers=2) as scorer:
        t0 = time.monotonic()
        scores = scorer.score(["a", "hang", "b", "hang", "c"], ["a", "x", "b", "x", "z"])
        assert scores == [1.0, 0.0, 1.0, 0.0, 0.0]
        assert time.monotonic() - t0 < 8
        assert scorer.num_timeouts == 2
        assert scorer.score(["q"], ["q"]) == [1.0]  # the pool still works


def test_crashing_worker_is_replaced_and_no_process_leaks():
    scorer = RewardScorer("tests.reward.hooks:crash_on_crash", timeout_s=5.0, num_workers=2)
    assert scorer.score(["a", "crash", "raise", "b"], ["a", "x", "x", "b"]) == [1.0, 0.0, 0.0, 1.0]
    assert scorer.num_crashes == 1
    pids = [w.proc.pid for w in scorer._workers]
    scorer.close()
    assert not any(pid_alive(p) for p in pids)
    with pytest.raises(RuntimeError, match="closed"):
        scorer.score(["a"], ["a"])


def test_items_spread_over_workers_and_match_in_process_scores():
    responses = [f"\\boxed{{{i % 7}}}" for i in range(40)]
    truths = [str(i % 5) for i in range(40)]
    assert score_batch(responses, truths, num_workers=2) == [math_score(r, t) for r, t in zip(responses, truths)]
    with RewardScorer("tests.reward.hooks:worker_pid", num_workers=2) as scorer:
        pids = set(scorer.score(["x"] * 20, ["y"] * 20))
        assert pids <= {float(w.proc.pid) for w in scorer._workers} and os.getpid() not in pids


def test_bad_reward_fn_in_worker_is_a_clear_error():
    with pytest.raises(ValueError, match="cannot import"):
        RewardScorer("tests.reward.no_such_module:f")
