"""The rollout mode's verbs (megamu.mode) and the cadences its plan answers (megamu.config.plan), each against
counts written out from the paper's schedule or against what the run's config derives, and the Trainer's
checkpointed state (Stateful) across a resume."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from torch.distributed.checkpoint.stateful import Stateful

from megamu.arguments import parse_args
from megamu.config.plan import AsyncPlan, StagedPlan, plan_type
from megamu.engines import EngineConfig, SGLangConfig
from megamu.engines.lifecycle import ColocatedLocal, RestartEachStage
from megamu.engines.sglang.colocated import ColocatedSGLang
from megamu.errors import ConfigError
from megamu.loop.state import QueueCursor, RunState
from megamu.loop.trainer import Trainer
from megamu.mode import ASYNC, COLOCATED, DEFAULT_MODE, STAGED, mode_of
from megamu.rollout.dataset import MANIFEST
from megamu.run.run_dir import RunDir
from megamu.runtime.device import Device


def test_each_name_gives_its_mode_and_any_other_is_refused():
    assert [mode_of(n) for n in ("staged", "colocated", "async")] == [STAGED, COLOCATED, ASYNC]
    with pytest.raises(ConfigError) as e:
        mode_of("pipelined")
    assert e.value.field == "rollout_mode" and "'pipelined'" in e.value.message


def staged_plan(mode: str = "staged", *, mu: int = 4, stages: int = 3) -> StagedPlan:
    return StagedPlan(prompts_per_update=2, n_samples_per_prompt=4, max_response_len=8, rollout_mode=mode,
                      num_stages=stages, mu=mu)


def async_plan(iters: int) -> AsyncPlan:
    return AsyncPlan(prompts_per_update=2, n_samples_per_prompt=4, max_response_len=8, train_iters=iters,
                     weight_sync_interval=4, max_policy_lag=8)


def test_each_plan_holds_its_mode_and_refuses_the_other_family():
    assert (staged_plan().mode, staged_plan("colocated").mode, async_plan(8).mode) == (STAGED, COLOCATED, ASYNC)
    assert StagedPlan().mode is DEFAULT_MODE is STAGED  # a plan built in code without a mode: the flag's default
    assert [plan_type(n) for n in ("staged", "colocated", "async")] == [StagedPlan, StagedPlan, AsyncPlan]
    for build, bad in ((lambda: staged_plan("async"), "'async' has no stages"),
                       (lambda: staged_plan("pipelined"), "'pipelined': expected one of"),
                       (lambda: replace(async_plan(8), rollout_mode="staged"), "'staged' has stages")):
        with pytest.raises(ConfigError) as e:
            build()
        assert e.value.field == "rollout_mode" and bad in e.value.message


def saves(plan, interval: int) -> list[int]:
    return [u for u in range(1, plan.total_updates + 1) if plan.checkpoint_due(u, interval)]


def test_checkpoint_cadence():
    # staged: each stage's end (a resume skips its rollout), and every interval-th update of a stage
    assert saves(staged_plan(), interval=0) == [4, 8, 12]
    assert saves(staged_plan(), interval=3) == [3, 4, 7, 8, 11, 12]
    # colocated and async refresh every μ or N updates: every interval-th update of the run and its end only
    assert saves(staged_plan("colocated"), interval=0) == [12]
    assert saves(staged_plan("colocated"), interval=5) == [5, 10, 12]
    assert saves(async_plan(12), interval=5) == [5, 10, 12]


def test_log_cadence():
    assert [u for u in range(1, 13) if staged_plan().log_due(u, 3)] == [3, 4, 7, 8, 11, 12]
    assert [u for u in range(1, 13) if staged_plan("colocated").log_due(u, 3)] == [3, 4, 7, 8, 11, 12]
    assert [u for u in range(1, 9) if async_plan(8).log_due(u, 3)] == [3, 6, 8]


def test_a_checkpoint_at_a_stage_end_completes_the_stage():
    assert staged_plan().stage_complete(1, 8) and staged_plan("colocated").stage_complete(1, 8)
    assert not staged_plan().stage_complete(1, 6)
    assert not async_plan(8).stage_complete(0, 8)  # no stages
    assert (staged_plan().where(2), async_plan(8).where(0)) == (" (stage 2)", "")


def test_each_mode_builds_its_lifecycle():
    assert type(STAGED.lifecycle(EngineConfig())) is RestartEachStage
    assert type(STAGED.lifecycle(EngineConfig(kind="sglang", sglang=SGLangConfig()))) is RestartEachStage
    assert type(COLOCATED.lifecycle(EngineConfig(kind="local"))) is ColocatedLocal
    assert type(COLOCATED.lifecycle(EngineConfig(kind="sglang", sglang=SGLangConfig()))) is ColocatedSGLang
    with pytest.raises(ValueError):
        ASYNC.lifecycle(EngineConfig())


@pytest.mark.parametrize("name", ["staged", "colocated", "async"])
def test_the_config_derives_what_the_mode_says(name, tmp_path):
    """The run's config, built from the flags, agrees with its mode on the trainer's offload and the servers'
    placement; the memory plan's push and release follow the same mode."""
    cfg = parse_args(["--rollout-mode", name, "--save", str(tmp_path / "run"), "--rollout-engine", "sglang",
                      *(["--train-iters", "8"] if name == "async" else [])], device=Device("cpu"))
    mode = cfg.plan.mode
    assert mode.name == name
    assert cfg.policy.offload_train == (name != "async") == mode.trainer_offloads
    assert cfg.engine.sglang.shares_trainer_devices == (name == "colocated") == mode.shares_trainer_devices
    assert cfg.engine.sglang.weight_sync == ("memory" if name == "colocated" else "disk")
    assert mode.weight_push("sglang", "disk") == ("disk" if name == "colocated" else None)
    assert mode.weight_push("local", "disk") == ("memory" if name == "colocated" else None)
    assert mode.releases_during_training("sglang", True) == (name == "colocated")
    assert not mode.releases_during_training("local", True) and not mode.releases_during_training("sglang", False)


def stage_folders(run_dir: RunDir, stages: int, done: int) -> None:
    """hf/stage_0..stages-1, the first ``done`` of them with a durable D_k."""
    for k in range(stages):
        run_dir.stage_export(k).mkdir(parents=True)
        if k < done:
            run_dir.stage_rollouts(k).mkdir(parents=True)
            (run_dir.stage_rollouts(k) / MANIFEST).write_text("{}")


def names(folder: Path, pattern: str) -> list[str]:
    return sorted(d.name for d in folder.glob(pattern))


def test_stage_export_retention(tmp_path):
    run_dir = RunDir(tmp_path)
    stage_folders(run_dir, 3, done=2)
    STAGED.prune_before_start(run_dir)  # a killed run's leftovers whose D_k is durable go
    assert names(run_dir.exports, "stage_*") == ["stage_2"]
    (run_dir.stage_rollouts(2)).mkdir(parents=True)
    (run_dir.stage_rollouts(2) / MANIFEST).write_text("{}")
    COLOCATED.prune_after_rollout(run_dir, 2, engine_keeps_it=True)  # servers launched from it: kept
    assert names(run_dir.exports, "stage_*") == ["stage_2"]
    COLOCATED.prune_at_end(run_dir)
    assert names(run_dir.exports, "stage_*") == []
    stage_folders(RunDir(tmp_path / "b"), 1, done=1)
    STAGED.prune_after_rollout(RunDir(tmp_path / "b"), 0, engine_keeps_it=False)
    assert names(tmp_path / "b" / "hf", "stage_*") == []


def test_sync_and_iter_export_retention(tmp_path):
    run_dir = RunDir(tmp_path)
    for v in (0, 4, 8, 12):
        run_dir.sync_export(v).mkdir(parents=True)
    ASYNC.prune_after_sync(run_dir, 8, keep=run_dir.sync_export(12))  # the engine serves 8: 0 and 4 go
    assert sorted(run_dir.sync_exports()) == [8, 12]
    ASYNC.prune_before_start(run_dir)  # a resume: every later folder came from a lost timeline
    assert run_dir.sync_exports() == {}
    for u in (2, 4, 6):
        run_dir.iter_export(u).mkdir(parents=True)
    STAGED.prune_iter_exports(run_dir, keep=2)
    assert names(run_dir.exports, "iter_*") == ["iter_0000004", "iter_0000006"]


def bare_trainer(plan) -> Trainer:
    """A Trainer's checkpointed part only (its state and plan): the model and the prompts play no part."""
    trainer = object.__new__(Trainer)
    trainer.plan, trainer.state = plan, RunState()
    return trainer


def test_the_trainer_checkpoints_its_progress_and_a_resume_skips_a_finished_stage():
    plan = StagedPlan(prompts_per_update=2, n_samples_per_prompt=4, max_response_len=8, algorithm="grpo",
                      num_stages=3, mu=4)
    saved = bare_trainer(plan)
    assert isinstance(saved, Stateful) and isinstance(saved.state, Stateful)
    saved.state.stage, saved.state.update, saved.state.elapsed = 1, 8, 12.5  # the save at stage 1's end
    checkpoint = saved.state_dict()
    assert checkpoint == {"stage": 1, "update": 8, "elapsed": 12.5, "rollout": {}, "plan": vars(plan)}
    resumed = bare_trainer(plan)
    resumed.load_state_dict(checkpoint)
    assert (resumed.state.stage, resumed.state.update, resumed.state.elapsed) == (2, 8, 12.5)
    mid = bare_trainer(plan)
    mid.load_state_dict({**checkpoint, "update": 6})  # an --save-interval save inside stage 1: redo its rest
    assert (mid.state.stage, mid.state.update) == (1, 6)


def test_an_async_checkpoint_carries_the_queue_cursor():
    plan = AsyncPlan(prompts_per_update=2, n_samples_per_prompt=4, max_response_len=8, algorithm="grpo",
                     train_iters=8, weight_sync_interval=4, max_policy_lag=8)
    saved = bare_trainer(plan)
    saved.state.update, saved.state.queue = 8, QueueCursor(cursor=9, dropped_stale=4, idle_s=1.0, busy_s=2.0)
    resumed = bare_trainer(plan)
    resumed.load_state_dict(saved.state_dict())
    assert (resumed.state.stage, resumed.state.update, resumed.state.queue) == (0, 8, saved.state.queue)
