"""Issue #33, item 2, as the user met it: a verl compute_score runs; a reward function that raises stops the run."""

import pytest

from tests.e2e.runs import flags, launch, records

pytestmark = pytest.mark.slow  # every test launches a trainer


def test_verls_compute_score_scores_as_megamus_own_function_does(tiny, reference, tmp_path):
    save = tmp_path / "verl"
    launch([*flags(tiny, save), "--reward-fn", "tests.e2e.rewards:compute_score"],
           env={"MEGAMU_CRASH_AFTER": "stage:0"}, check=False)  # stage 0 is enough
    got, want = records(save, "stage"), records(reference, "stage")
    # the same seeds and the same score under another signature: stage 0's rollout reward is the reference's
    assert got[0]["reward_mean"] == want[0]["reward_mean"] > 0
    assert got[0]["reward_errors"] == 0 and got[0]["reward_timeouts"] == 0


def test_a_reward_function_that_always_raises_stops_the_run_at_its_first_shard(tiny, tmp_path):
    save = tmp_path / "typo"
    proc = launch([*flags(tiny, save), "--reward-fn", "tests.e2e.rewards:compute_score_typo"], check=False)
    assert proc.returncode != 0
    for part in ("RewardFunctionError", "tests.e2e.rewards:compute_score_typo", "(verl signature)",
                 "KeyError: 'answer'", "one offending sample: ground truth"):
        assert part in proc.stderr, part
    assert not list((save / "rollouts" / "stage_0").glob("*.parquet"))  # no shard scored with zeros was kept
    assert not records(save, "update") if (save / "metrics.jsonl").exists() else True


def test_slime_message_rows_and_custom_rm_train(tiny, tmp_path):
    """Issue #33, item 3 as a slime user runs it: message rows, --input-key/--label-key/--apply-chat-template,
    --custom-rm-path with a coroutine reading the row's metadata."""
    import json

    data = tmp_path / "dapo.jsonl"
    data.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": f"{i} + 1 = ?"}], "label": str(i + 1),
                                        "metadata": {"weight": 0.25}}) + "\n" for i in range(24)))
    save = tmp_path / "slime"
    proc = launch([*flags(tiny, save), "--prompt-data", str(data), "--input-key", "prompt", "--label-key", "label",
                   "--apply-chat-template", "--custom-rm-path", "tests.e2e.rewards.custom_rm"],
                  env={"MEGAMU_CRASH_AFTER": "stage:0"}, check=False)
    stage, = records(save, "stage")
    assert stage["reward_mean"] == 0.25 and stage["reward_errors"] == 0, proc.stderr[-2000:]
