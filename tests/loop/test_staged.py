"""train_staged driven in-process: a fake policy (records what it is asked for) and the real local engine, through
each mode's lifecycle, three stages, and a resume that starts a new lifecycle mid-run."""

from __future__ import annotations

import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest

from megamu.algo import ALGORITHM_PRESETS
from megamu.config.loop_config import EvalConfig
from megamu.config.plan import StagedPlan
from megamu.engines import EngineConfig
from megamu.engines.lifecycle import base as lifecycle_base
from megamu.engines.local import LocalEngine
from megamu.engines.weights import Weights
from megamu.loop.staged import train_staged
from megamu.loop.state import RunState
from megamu.loop.trainer import Trainer
from megamu.reward.config import RewardConfig
from megamu.rollout import RolloutConfig
from megamu.run.run_dir import RunDir
from tests.rollout.test_phase import make_prompts
from tests.tiny import build_char_tokenizer, save_tiny_model

MU, PROMPTS = 2, 4


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("tiny"), "llama", seed=0)


class FakePolicy:
    """θ never changes (the engines' part is under test): its folder is the tiny model, its tensors that model's."""

    def __init__(self, model: Path, events: list):
        self.model, self.events, self.version = model, events, 0

    def weights(self, *, hf_dir=None, tensors=False, every_node=False, probe_ids=None) -> Weights:
        self.events.append(("gather", "folder" if hf_dir else "tensors"))
        if hf_dir is not None:
            shutil.copytree(self.model, hf_dir, dirs_exist_ok=True)
        state = dict(LocalEngine(str(self.model)).model.state_dict()) if tensors else None
        return Weights(version=self.version, hf_dir=hf_dir, tensors=state)

    def offload(self):
        self.events.append(("offload",))

    def onload(self):
        self.events.append(("onload",))


class FakeRun:
    """What train_staged reads of megamu.loop.trainer.Trainer; updates and stage records are recorded, not trained:
    an update saves when the plan's cadence says (as the Trainer asks it), the stage counter moves at stage_done."""

    def __init__(self, mode: str, root: Path, model: Path, num_stages: int, state: RunState, events: list):
        tok = build_char_tokenizer()
        self.cfg = SimpleNamespace(
            engine=EngineConfig(), evaluation=EvalConfig(), seed=0, recompute_behaviour_logprobs=False,
            algo=ALGORITHM_PRESETS["mu-grpo"],  # the rollout reads its DAPO settings (off)
            log_interval=1, save_interval=0,
            rollout=RolloutConfig(n_samples=2, seed=1234, max_new_tokens=4, groups_per_shard=2,
                                  reward=RewardConfig(reward_fn="tests.rollout.rewards:parity", num_workers=1)))
        self.plan = StagedPlan(num_stages=num_stages, mu=MU, prompts_per_update=2, rollout_mode=mode)
        prompts = make_prompts(tok)
        self.prompts = SimpleNamespace(held_out=prompts[PROMPTS:], eval_sets={"held-out": prompts[PROMPTS:]},
                                       train=prompts[:PROMPTS], for_stage=lambda stage: prompts[:PROMPTS])
        self.policy, self.run_dir, self.state, self.tokenizer = FakePolicy(model, events), RunDir(root), state, tok
        self.metrics = SimpleNamespace(log=lambda kind, **f: kind == "eval" and events.append((kind, f["label"])))
        self.eta_shown, self.events = True, events

    def train_on(self, samples, bar):
        self.state.update += 1
        save = self.plan.checkpoint_due(self.state.update, self.cfg.save_interval)
        self.events.append(("update", self.state.update, "save" if save else ""))

    def progress_bar(self, desc, total, initial):
        return SimpleNamespace(close=lambda: None)

    def stage_done(self, stage, dataset, **times):
        self.state.stage = stage + 1
        self.events.append(("stage", stage, dataset.num_groups,
                            sorted(p.name for p in self.run_dir.stage_export(0).parent.glob("stage_*"))))

    def export_final(self) -> Weights:
        return self.policy.weights(hf_dir=self.run_dir.final_export)

    sampling, evaluate, final_evaluation = Trainer.sampling, Trainer.evaluate, Trainer.final_evaluation  # the real ones


@pytest.fixture
def starts(monkeypatch):
    """The folders engines were started from."""
    started = []
    real = lifecycle_base.build_engine

    def build(cfg, hf_dir):
        started.append(Path(hf_dir).name)
        return real(cfg, hf_dir)

    monkeypatch.setattr(lifecycle_base, "build_engine", build)
    return started


def stage_events(stage: int, gather: str, exports: list[str]) -> list:
    first = MU * stage + 1
    return [("gather", gather), ("offload",), ("offload",), *([("eval", "base")] if stage == 0 else []), ("onload",),
            ("update", first, ""), ("update", first + 1, "save"), ("stage", stage, PROMPTS, exports)]


def test_staged_mode_starts_an_engine_each_stage_and_checkpoints_each_stage_end(tmp_path, model, starts):
    events = []
    train_staged(FakeRun("staged", tmp_path, model, 3, RunState(), events))
    assert starts == ["stage_0", "stage_1", "stage_2", "final"]
    assert events == [*stage_events(0, "folder", []), *stage_events(1, "folder", []),
                      *stage_events(2, "folder", []), ("gather", "folder"), ("offload",), ("eval", "final"),
                      ("onload",)]


def test_colocated_mode_starts_once_pushes_tensors_and_checkpoints_at_the_run_end(tmp_path, model, starts):
    events = []
    train_staged(FakeRun("colocated", tmp_path, model, 3, RunState(), events))
    assert starts == ["stage_0"]  # one engine: later stages and the final evaluation push into it
    expected = [*stage_events(0, "folder", []), *stage_events(1, "tensors", []), *stage_events(2, "tensors", [])]
    for i, e in enumerate(expected):  # one checkpoint, at the run's end (not at each refresh)
        if e[0] == "update":
            expected[i] = ("update", e[1], "save" if e[1] == 3 * MU else "")
    assert events == [*expected, ("gather", "folder"), ("offload",), ("eval", "final"), ("onload",)]
    assert not list((tmp_path / "hf").glob("stage_*"))  # every stage's export pruned once its D_k was durable


@pytest.mark.parametrize("mode", ["staged", "colocated"])
def test_a_resumed_run_starts_a_new_engine_on_the_stage_it_resumes(tmp_path, model, starts, mode):
    """A first process runs stage 0 and stops; the next resumes at stage 1 with a new lifecycle: its engine starts
    from stage 1's export, and (colocated) stage 2 gets a push."""
    train_staged(FakeRun(mode, tmp_path, model, 1, RunState(), []))
    starts.clear()
    events = []
    train_staged(FakeRun(mode, tmp_path, model, 3, RunState(stage=1, update=MU), events))
    gathers = [e[1] for e in events if e[0] == "gather"][:2]
    assert starts[0] == "stage_1"
    assert gathers == (["folder", "folder"] if mode == "staged" else ["folder", "tensors"])
    assert [e[1] for e in events if e[0] == "update"] == [3, 4, 5, 6]
