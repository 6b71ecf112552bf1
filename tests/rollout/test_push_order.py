"""The order of a colocated refresh and of the final evaluation: the trainer's device memory goes back before the
servers' weights (or a fresh engine) come back, and the pushed tensors' blocks before their KV cache does.

slime orders its colocated refresh so (THUDM/slime train.py:82-88 at 624b824: ``offload_train``, then
``rollout_manager.onload_weights``, ``actor_model.update_weights()``, ``rollout_manager.onload_kv``); a server's
weights and KV cache are separate torch_memory_saver tags (SGLang 0.5.23 ``/resume_memory_occupation`` ``tags``).
On an H200 the old order (gather, resume, push, then offload) held the trainer's ~44 GiB, the gathered model and the
servers' weights at once."""

from dataclasses import dataclass
from pathlib import Path

import pytest

from megamu.engines.sglang import memory
from megamu.loop.staged import StageEngine, WeightRequest, final_evaluation, publish
from megamu.weights import Weights


class Events(list):
    pass


class FakePolicy:
    def __init__(self, events):
        self.events = events

    def weights(self, *, hf_dir=None, tensors=False, every_node=False, probe_ids=None):
        self.events.append("gather")
        return Weights(version=1, hf_dir=hf_dir, tensors={"w": object()} if tensors else None)

    def onload(self):
        self.events.append("trainer onload")

    def offload(self):
        self.events.append("trainer offload + empty_cache")


class FakeStageEngine(StageEngine):
    """StageEngine's own ``load``/``wake`` ordering is kept; only the server calls are recorded."""

    def __init__(self, events, warm, tensors):
        self.events, self.warm, self.want = events, warm, tensors
        self.released, self.pending, self.report = memory.ALL if warm else (), None, None
        self.engine = object()

    def wants(self):
        return WeightRequest(folder=not (self.warm and self.want), tensors=self.warm and self.want)

    def load(self, weights, stage):
        if self.warm:
            self._resume(memory.WEIGHTS)
            self.events.append("push tensors" if weights.tensors else "push folder")

    def wake(self):
        self._resume(*memory.ALL)

    def evaluate(self, stage, update, label, weights=None):
        self.events.append(f"evaluate {label}")


@pytest.fixture
def events(monkeypatch):
    ev = Events()
    monkeypatch.setattr(memory, "resume", lambda engine, tags: ev.append("resume " + ",".join(tags)))
    return ev


@pytest.mark.parametrize("tensors", [True, False], ids=["memory-sync", "disk-sync"])
def test_colocated_refresh_offloads_the_trainer_before_the_servers_weights_return(events, tensors):
    publish(FakePolicy(events), FakeStageEngine(events, warm=True, tensors=tensors), 1, Path("/x"))
    push = "push tensors" if tensors else "push folder"
    assert events == ["gather", "trainer offload + empty_cache", "resume weights", push,
                      "trainer offload + empty_cache", "resume kv_cache,cuda_graph"]


def test_first_stage_starts_its_engine_after_the_trainer_offloads(events):
    publish(FakePolicy(events), FakeStageEngine(events, warm=False, tensors=False), 0, Path("/x"))
    assert events[:2] == ["gather", "trainer offload + empty_cache"]
    assert not any(e.startswith("resume") for e in events)


@dataclass
class FakeRun:
    policy: FakePolicy
    plan: object
    state: object = None

    def export_final(self):
        return self.policy.weights(hf_dir=Path("/final"))


def test_final_evaluation_runs_after_the_trainer_offloads(events):
    @dataclass
    class Plan:
        num_stages: int = 2

    @dataclass
    class State:
        update: int = 8

    final_evaluation(FakeRun(FakePolicy(events), Plan(), State()), FakeStageEngine(events, warm=True, tensors=False))
    assert events == ["gather", "trainer offload + empty_cache", "evaluate final", "trainer onload"]
