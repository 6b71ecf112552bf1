"""Issue #33, item 1: a run's start point (--load, --pretrained-checkpoint) and its resume point (--save) apart."""

import pytest

from megamu.arguments import parse_args
from tests.e2e.runs import MU, STAGES, flags, launch, records


@pytest.mark.slow
def test_kill_and_rerun_with_load_a_save_b_resumes_from_b(tiny, tmp_path):
    """The user's steps: `--load A --save B`, killed after B saved update 6, then the same command again."""
    a, b = tmp_path / "A", tmp_path / "B"
    assert launch(flags(tiny, a), env={"MEGAMU_CRASH_AFTER": "update:2"}, check=False).returncode != 0
    assert (a / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    command = flags(tiny, b, "--load", str(a))
    first = launch(command, env={"MEGAMU_CRASH_AFTER": "update:6"}, check=False)
    assert first.returncode != 0 and f"started from the earlier run in {a}: update 2" in first.stdout
    assert (b / "latest_checkpointed_iteration.txt").read_text().strip() == "6"
    before = records(b, "update")
    assert [u["update"] for u in before] == list(range(2, 6))  # A's progress continued in B (0-based: updates 3-6)
    second = launch(command)
    assert f"resumed from {b}: update 6 of {STAGES * MU} (stage 1)" in second.stdout
    after = records(b, "update")
    assert [u["update"] for u in after] == list(range(2, STAGES * MU))
    assert after[:4] == before  # what B's checkpoint covers is kept as it was written
    assert (b / "latest_checkpointed_iteration.txt").read_text().strip() == str(STAGES * MU)
    assert (a / "latest_checkpointed_iteration.txt").read_text().strip() == "2"  # the start point is only read


def test_a_start_point_without_a_checkpoint_is_a_clear_error(tiny, tmp_path):
    (tmp_path / "empty").mkdir()
    for flag in ("--load", "--pretrained-checkpoint"):
        with pytest.raises(SystemExit, match=f"{flag}: {tmp_path / 'empty'} holds no checkpoint"):
            parse_args(flags(tiny, tmp_path / "run", flag, str(tmp_path / "empty")))
    # --load equal to --save (slime's scripts) is a run's own directory: a new run starts there
    assert parse_args(flags(tiny, tmp_path / "run", "--load", str(tmp_path / "run"))).policy.checkpoint.load is not None
