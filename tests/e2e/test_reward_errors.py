"""Issue #33, item 2, as the user met it: a verl compute_score runs; a reward function that raises stops the run."""

from tests.e2e.test_pretrain import flags, launch, records, reference, tiny  # noqa: F401  (fixtures)


def test_verls_compute_score_scores_as_megamus_own_function_does(tiny, reference, tmp_path):  # noqa: F811
    save = tmp_path / "verl"
    launch([*flags(tiny, save), "--reward-fn", "tests.e2e.rewards:compute_score"],
           env={"MEGAMU_CRASH_AFTER": "stage:0"}, check=False)  # stage 0 is enough
    got, want = records(save, "stage"), records(reference, "stage")
    # the same seeds and the same score under another signature: stage 0's rollout reward is the reference's
    assert got[0]["reward_mean"] == want[0]["reward_mean"] > 0
    assert got[0]["reward_errors"] == 0 and got[0]["reward_timeouts"] == 0


def test_a_reward_function_that_always_raises_stops_the_run_at_its_first_shard(tiny, tmp_path):  # noqa: F811
    save = tmp_path / "typo"
    proc = launch([*flags(tiny, save), "--reward-fn", "tests.e2e.rewards:compute_score_typo"], check=False)
    assert proc.returncode != 0
    for part in ("RewardFunctionError", "tests.e2e.rewards:compute_score_typo", "(verl signature)",
                 "KeyError: 'answer'", "one offending sample: ground truth"):
        assert part in proc.stderr, part
    assert not list((save / "rollouts" / "stage_0").glob("*.parquet"))  # no shard scored with zeros was kept
    assert not records(save, "update") if (save / "metrics.jsonl").exists() else True
