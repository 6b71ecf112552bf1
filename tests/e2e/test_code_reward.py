"""End to end with the code reward: `pretrain_mu_grpo.py --reward code` on the shipped code task with a tiny model."""

import json

import pytest

from megamu.arguments import parse_args
from megamu.data.code_task import code_problems
from megamu.reward import RewardConfig
from tests.e2e.runs import launch, records

pytestmark = pytest.mark.sandbox  # one such test at a time over the workers (tests/reward/sandbox_checks.py)


def code_flags(model, save, data, *extra: str) -> list[str]:
    return ["--hf-checkpoint", str(model), "--save", str(save), "--prompt-data", str(data), "--reward", "code",
            "--code-timeout", "2", "--num-stages", "1", "--prompts-per-stage", "4", "--prompts-per-update", "2",
            "--n-samples-per-prompt", "2", "--rollout-max-response-len", "12", "--eval-prompts", "2",
            "--micro-batch-size", "4", "--rollout-groups-per-shard", "2", "--seed", "3", "--max-prompt-length", "512",
            *extra]


@pytest.fixture
def task(tmp_path):
    path = tmp_path / "code_task.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in code_problems(12, seed=0)))
    return path


@pytest.mark.slow
def test_code_reward_run_completes(tiny, tmp_path, task):
    save = tmp_path / "run"
    launch(code_flags(tiny, save, task))
    updates, stages = records(save, "update"), records(save, "stage")
    assert len(updates) == 2 and len(stages) == 1
    # 12 random characters cannot hold a ```python block: every sample scores 0, and nothing crashed on the way.
    assert stages[0]["reward_mean"] == 0.0
    assert (save / "hf" / "final" / "config.json").is_file()


def test_reward_flags_make_the_reward_config(tiny, tmp_path, task):
    cfg = parse_args(code_flags(tiny, tmp_path / "x", task, "--code-reward-mode", "fraction",
                                "--code-sandbox-url", "http://127.0.0.1:8000/run"))
    assert cfg.prompts.answer_key == "tests"
    assert cfg.rollout.reward == RewardConfig(kind="code", code_mode="fraction",
                                              sandbox_url="http://127.0.0.1:8000/run", timeout_s=2.0)
    cfg = parse_args(["--save", str(tmp_path / "y")])
    assert (cfg.prompts.answer_key, cfg.rollout.reward) == ("answer", RewardConfig())
    cfg = parse_args(["--save", str(tmp_path / "z"), "--reward", "code", "--reward-fn", "tests.e2e.rewards:has_digit"])
    assert cfg.rollout.reward.spec_and_kwargs() == ("tests.e2e.rewards:has_digit", {})  # --reward-fn wins


@pytest.mark.parametrize("bad, flag", [
    (["--code-timeout", "0"], "--code-timeout"),
    (["--code-sandbox-url", "ftp://x"], "--code-sandbox-url"),
    (["--reward", "math", "--code-reward-mode", "fraction"], "--code-reward-mode"),
])
def test_bad_reward_flags_name_the_flag(tiny, tmp_path, task, bad, flag):
    with pytest.raises(SystemExit, match=flag):
        parse_args(code_flags(tiny, tmp_path / "bad", task, *bad))
