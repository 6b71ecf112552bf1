"""Issue #45, item 2: reward judges fail loudly and run at the user's concurrency; slime's args, Sample, --reward-key
and --group-rm; verl's data_source routing to megamu's own scorers. References: the user's functions' own steps,
computed by hand."""

import pytest

from megamu.reward import RewardConfig, RewardScorer, make_scorer
from megamu.reward.pool import RewardFunctionError
from megamu.reward.signatures import CallOptions, RowMeta


def test_a_judge_that_always_hangs_stops_the_run_naming_the_timeout():
    cfg = RewardConfig(reward_fn="tests.reward.hooks:always_hangs", item_timeout=0.5)  # tolerance 0, the default
    with make_scorer(cfg) as scorer, pytest.raises(RewardFunctionError) as e:
        scorer.score(["a reply"], ["42"])
    message = str(e.value)
    for part in ("tests.reward.hooks:always_hangs", "timed out after 0.5 s (--reward-timeout)", "1 of 1",
                 "--reward-error-tolerance", "'a reply'"):
        assert part in message, part


def test_timeouts_count_against_the_tolerance_like_errors():
    cfg = RewardConfig(reward_fn="tests.reward.hooks:hang_on_hang", item_timeout=0.5, max_error_fraction=0.25,
                       num_workers=2)
    with make_scorer(cfg) as scorer:
        assert scorer.score(["a", "hang", "b", "c"], ["a", "x", "b", "x"]) == [1.0, 0.0, 1.0, 0.0]  # 1 of 4: tolerated
        assert (scorer.num_timeouts, scorer.num_errors, scorer.num_failed) == (1, 0, 1)
        with pytest.raises(RewardFunctionError, match=r"failed on 3 of 6 samples \(0 raised, 3 timed out"):
            scorer.score(["hang", "hang"], ["x", "x"])


def test_megamus_own_scorer_times_out_a_reply_without_stopping_the_run():
    """A reply that sends math-verify into a long search is the reply's fault: counted, scored 0, not an error."""
    with RewardScorer("tests.reward.hooks:hang_on_hang", timeout_s=0.5, num_workers=1, max_error_fraction=0.0,
                      timeouts_are_errors=False) as scorer:
        assert scorer.score(["hang", "a"], ["x", "a"]) == [0.0, 1.0]
        assert scorer.num_timeouts == 1 and scorer.num_failed == 0


def test_no_call_of_the_users_function_outside_a_timeout(tmp_path, monkeypatch):
    """The worker calls the function only on the items it is given: no dummy warm-up item (a remote judge would get
    it, outside any timeout, at every worker start)."""
    calls = tmp_path / "calls.txt"
    monkeypatch.setenv("MEGAMU_TEST_CALLS", str(calls))
    with make_scorer(RewardConfig(reward_fn="tests.reward.hooks:logs_calls", num_workers=2)) as scorer:
        assert scorer.score(["r1", "r2", "r3"], ["x"] * 3) == [1.0] * 3
    assert sorted(calls.read_text().split()) == ["r1", "r2", "r3"]
    # megamu's own scorer is warmed up (its lazy imports must not count against an item)
    assert RewardConfig().call_options().warm_up and not RewardConfig(reward_fn="m:f").call_options().warm_up


def test_reward_workers_sets_the_pool_size():
    with make_scorer(RewardConfig(reward_fn="tests.reward.hooks:worker_pid", num_workers=3)) as scorer:
        assert len(scorer._workers) == 3
        pids = {w.proc.pid for w in scorer._workers}
        assert set(scorer.score(["x"] * 30, ["y"] * 30)) <= {float(p) for p in pids}


@pytest.mark.parametrize("concurrency", [1, 4])
def test_async_functions_run_at_the_given_concurrency_per_worker(concurrency):
    cfg = RewardConfig(reward_fn="tests.reward.hooks.peak_in_flight", num_workers=1, concurrency=concurrency,
                       item_timeout=30.0)
    with make_scorer(cfg) as scorer:
        assert max(scorer.score(["r"] * 4, ["x"] * 4)) == concurrency


def test_concurrency_needs_an_async_function():
    with pytest.raises(ValueError, match="--reward-concurrency 2.*not async.*--reward-workers"):
        make_scorer(RewardConfig(reward_fn="tests.reward.hooks:worker_pid", concurrency=2))


def test_slimes_custom_rm_gets_the_runs_args_and_a_full_sample():
    meta = RowMeta("toy", {"level": 3}, prompt="1+1=?", rendered_prompt="<user>1+1=?<assistant>",
                   finish_reason="length", prompt_ids=[5, 6, 7], response_ids=[8, 9])
    cfg = RewardConfig(reward_fn="tests.reward.hooks.custom_rm_reads_args_and_sample", max_error_fraction=0.0,
                       num_workers=1, run_args={"n_samples_per_prompt": 8})
    with make_scorer(cfg) as scorer:
        # 8 x 1000 + rendered prompt 100 + 5 tokens x 10 + TRUNCATED 1 + == "truncated" 0.5 + length 0.25 + metadata
        assert scorer.score(["42"], ["2"], [meta]) == [8000 + 100 + 50 + 1 + 0.5 + 0.25 + 0.125]


def test_the_trainers_flags_reach_custom_rm_as_args():
    from megamu.arguments import parse_args

    run = parse_args(["--custom-rm-path", "tests.reward.hooks.custom_rm_reads_args_and_sample",
                      "--n-samples-per-prompt", "6", "--dry-run"])
    args = run.rollout.reward.run_args
    assert args["n_samples_per_prompt"] == 6
    assert args["reward_fn"] == "tests.reward.hooks.custom_rm_reads_args_and_sample"
    assert isinstance(args["save"], str)  # a Path, as JSON for the worker processes


def test_reward_key_picks_the_dicts_entry():
    with make_scorer(RewardConfig(reward_fn="tests.reward.hooks:judge_dict", reward_key="acc", num_workers=1,
                                  max_error_fraction=0.0)) as scorer:
        assert scorer.score(["a", "b"], ["a", "a"]) == [1.0, 0.0]
    with make_scorer(RewardConfig(reward_fn="tests.reward.hooks:judge_dict", reward_key="pass", num_workers=1,
                                  max_error_fraction=0.0)) as scorer, pytest.raises(RewardFunctionError) as e:
        scorer.score(["a"], ["a"])
    assert "without the key 'pass' (--reward-key)" in str(e.value)


def test_group_rm_calls_once_per_group_with_its_samples():
    cfg = RewardConfig(reward_fn="tests.reward.hooks:group_rank", group_rm=True, num_workers=2, max_error_fraction=0.0)
    responses = ["ccc", "a", "bb", "dddd", "xx", "x"]  # two groups of 3: ranks by length within each
    with make_scorer(cfg) as scorer:
        assert scorer.score(responses, ["t"] * 6, group_size=3) == [2.0, 0.0, 1.0, 2.0, 1.0, 0.0]
    bad = RewardConfig(reward_fn="tests.reward.hooks:group_short", group_rm=True, num_workers=1, max_error_fraction=0.0)
    with make_scorer(bad) as scorer, pytest.raises(RewardFunctionError, match="one reward per sample of the group"):
        scorer.score(["a", "b"], ["t", "t"], group_size=2)
    with pytest.raises(ValueError, match="--group-rm"):
        RewardScorer("tests.reward.hooks:worker_pid", options=CallOptions(group=True))
