"""Trainer.train and close (torchtitan/train.py's main: ``trainer.train()``, then ``trainer.close()``): the mode's
loop runs, then the run's record; the process groups stop only after a run that returned."""

from __future__ import annotations

import pytest

import megamu.loop.async_ as async_loop
import megamu.loop.staged as staged_loop
from megamu.config.plan import AsyncPlan, StagedPlan
from megamu.loop.trainer import Trainer
from megamu.runtime import parallel

PLANS = {"staged": StagedPlan(), "colocated": StagedPlan(rollout_mode="colocated"), "async": AsyncPlan(train_iters=4)}


def bare_trainer(mode: str, calls: list) -> Trainer:
    """A Trainer without its parts: what train and close do with them is recorded."""
    trainer = object.__new__(Trainer)
    trainer.plan, trainer._trained = PLANS[mode], False
    trainer.finish = lambda: calls.append("finish")
    return trainer


@pytest.fixture
def calls(monkeypatch) -> list:
    calls: list = []
    monkeypatch.setattr(staged_loop, "train_staged", lambda t: calls.append(("staged loop", t.plan.rollout_mode)))
    monkeypatch.setattr(async_loop, "train_async", lambda t: calls.append(("async loop", t.plan.rollout_mode)))
    monkeypatch.setattr(parallel, "destroy_distributed", lambda: calls.append("destroy"))
    return calls


@pytest.mark.parametrize("mode, loop", [("staged", "staged loop"), ("colocated", "staged loop"),
                                        ("async", "async loop")])
def test_train_runs_the_modes_loop_then_the_runs_record_and_close_stops_the_groups(calls, mode, loop):
    trainer = bare_trainer(mode, calls)
    try:
        trainer.train()
    finally:
        trainer.close()
    assert calls == [(loop, mode), "finish", "destroy"]


def test_after_a_failed_loop_close_leaves_the_groups_to_the_launcher(calls, monkeypatch):
    def crash(trainer):
        raise RuntimeError("rank 1 lost")

    monkeypatch.setattr(staged_loop, "train_staged", crash)
    trainer = bare_trainer("staged", calls)
    with pytest.raises(RuntimeError, match="rank 1 lost"):
        try:
            trainer.train()
        finally:
            trainer.close()
    assert calls == []  # no summary of a run that did not end, no destroy behind a collective that may hang
