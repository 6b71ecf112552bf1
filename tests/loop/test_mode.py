"""The rollout mode's verbs (megamu.mode), each against counts written out from the paper's schedule or against what
the run's config derives, and the Trainer's checkpointed state (Stateful) across a resume."""

from __future__ import annotations

from pathlib import Path

import pytest
from torch.distributed.checkpoint.stateful import Stateful

from megamu.arguments import parse_args
from megamu.config.plan import AsyncPlan, StagedPlan
from megamu.engines import EngineConfig, SGLangConfig
from megamu.engines.lifecycle import ColocatedLocal, RestartEachStage
from megamu.engines.sglang.colocated import ColocatedSGLang
from megamu.errors import ConfigError
from megamu.loop.state import QueueCursor, RunState
from megamu.loop.trainer import Trainer
from megamu.mode import ASYNC, COLOCATED, STAGED, mode_of
from megamu.rollout.dataset import MANIFEST
from megamu.run.run_dir import RunDir
from megamu.runtime.device import Device


def test_each_name_gives_its_mode_and_any_other_is_refused():
    assert [mode_of(n) for n in ("staged", "colocated", "async")] == [STAGED, COLOCATED, ASYNC]
    with pytest.raises(ConfigError) as e:
        mode_of("pipelined")
    assert e.value.field == "rollout_mode" and "'pipelined'" in e.value.message


def saves(mode, *, mu: int, total: int, interval: int) -> list[int]:
    return [u for u in range(1, total + 1) if mode.checkpoint_due(u, mu, total, interval)]


def test_checkpoint_cadence():
    # staged: each stage's end (a resume skips its rollout), and every interval-th update of a stage
    assert saves(STAGED, mu=4, total=12, interval=0) == [4, 8, 12]
    assert saves(STAGED, mu=4, total=12, interval=3) == [3, 4, 7, 8, 11, 12]
    # colocated and async refresh every μ or N updates: every interval-th update of the run and its end only
    assert saves(COLOCATED, mu=4, total=12, interval=0) == [12]
    assert saves(COLOCATED, mu=4, total=12, interval=5) == [5, 10, 12]
    assert saves(ASYNC, mu=None, total=12, interval=5) == [5, 10, 12]


def test_log_cadence():
    assert [u for u in range(1, 13) if STAGED.log_due(u, 4, 12, 3)] == [3, 4, 7, 8, 11, 12]
    assert [u for u in range(1, 13) if COLOCATED.log_due(u, 4, 12, 3)] == [3, 4, 7, 8, 11, 12]
    assert [u for u in range(1, 9) if ASYNC.log_due(u, None, 8, 3)] == [3, 6, 8]


def test_a_checkpoint_at_a_stage_end_completes_the_stage():
    assert STAGED.stage_complete(1, 8, 4) and COLOCATED.stage_complete(1, 8, 4)
    assert not STAGED.stage_complete(1, 6, 4)
    assert not ASYNC.stage_complete(0, 8, None)  # no stages
    assert (STAGED.where(2), ASYNC.where(0)) == (" (stage 2)", "")


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
    mode = mode_of(cfg.plan.rollout_mode)
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


def bare_trainer(mode, plan) -> Trainer:
    """A Trainer's checkpointed part only (its state, mode and plan): the model and the prompts play no part."""
    trainer = object.__new__(Trainer)
    trainer.mode, trainer.plan, trainer.state = mode, plan, RunState()
    return trainer


def test_the_trainer_checkpoints_its_progress_and_a_resume_skips_a_finished_stage():
    plan = StagedPlan(prompts_per_update=2, n_samples_per_prompt=4, max_response_len=8, algorithm="grpo",
                      num_stages=3, mu=4)
    saved = bare_trainer(STAGED, plan)
    assert isinstance(saved, Stateful) and isinstance(saved.state, Stateful)
    saved.state.stage, saved.state.update, saved.state.elapsed = 1, 8, 12.5  # the save at stage 1's end
    checkpoint = saved.state_dict()
    assert checkpoint == {"stage": 1, "update": 8, "elapsed": 12.5, "rollout": {}, "plan": vars(plan)}
    resumed = bare_trainer(STAGED, plan)
    resumed.load_state_dict(checkpoint)
    assert (resumed.state.stage, resumed.state.update, resumed.state.elapsed) == (2, 8, 12.5)
    mid = bare_trainer(STAGED, plan)
    mid.load_state_dict({**checkpoint, "update": 6})  # an --save-interval save inside stage 1: redo its rest
    assert (mid.state.stage, mid.state.update) == (1, 6)


def test_an_async_checkpoint_carries_the_queue_cursor():
    plan = AsyncPlan(prompts_per_update=2, n_samples_per_prompt=4, max_response_len=8, algorithm="grpo",
                     train_iters=8, weight_sync_interval=4, max_policy_lag=8)
    saved = bare_trainer(ASYNC, plan)
    saved.state.update, saved.state.queue = 8, QueueCursor(cursor=9, dropped_stale=4, idle_s=1.0, busy_s=2.0)
    resumed = bare_trainer(ASYNC, plan)
    resumed.load_state_dict(saved.state_dict())
    assert (resumed.state.stage, resumed.state.update, resumed.state.queue) == (0, 8, saved.state.queue)
