"""Trainer.train and close (torchtitan/train.py's main: ``trainer.train()``, then ``trainer.close()``): the mode's
loop runs, then the run's record; the process groups stop only after a run that returned."""

from __future__ import annotations

import pytest

import megamu.loop.async_ as async_loop
import megamu.loop.staged as staged_loop
from megamu.loop.trainer import Trainer
from megamu.mode import ASYNC, COLOCATED, STAGED
from megamu.runtime import parallel


def bare_trainer(mode, calls: list) -> Trainer:
    """A Trainer without its parts: what train and close do with them is recorded."""
    trainer = object.__new__(Trainer)
    trainer.mode, trainer._trained = mode, False
    trainer.finish = lambda: calls.append("finish")
    return trainer


@pytest.fixture
def calls(monkeypatch) -> list:
    calls: list = []
    monkeypatch.setattr(staged_loop, "train_staged", lambda trainer: calls.append(("staged loop", trainer.mode.name)))
    monkeypatch.setattr(async_loop, "train_async", lambda trainer: calls.append(("async loop", trainer.mode.name)))
    monkeypatch.setattr(parallel, "destroy_distributed", lambda: calls.append("destroy"))
    return calls


@pytest.mark.parametrize("mode, loop", [(STAGED, "staged loop"), (COLOCATED, "staged loop"), (ASYNC, "async loop")])
def test_train_runs_the_modes_loop_then_the_runs_record_and_close_stops_the_groups(calls, mode, loop):
    trainer = bare_trainer(mode, calls)
    try:
        trainer.train()
    finally:
        trainer.close()
    assert calls == [(loop, mode.name), "finish", "destroy"]


def test_after_a_failed_loop_close_leaves_the_groups_to_the_launcher(calls, monkeypatch):
    def crash(trainer):
        raise RuntimeError("rank 1 lost")

    monkeypatch.setattr(staged_loop, "train_staged", crash)
    trainer = bare_trainer(STAGED, calls)
    with pytest.raises(RuntimeError, match="rank 1 lost"):
        try:
            trainer.train()
        finally:
            trainer.close()
    assert calls == []  # no summary of a run that did not end, no destroy behind a collective that may hang
