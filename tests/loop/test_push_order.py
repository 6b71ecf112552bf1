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

from megamu.engines import EngineConfig, SGLangConfig
from megamu.engines.sglang.colocated import ColocatedSGLang
from megamu.engines.sglang.weight_sync import SyncReport
from megamu.engines.weights import Weights
from megamu.loop.staged import publish
from megamu.loop.trainer import Trainer


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


class FakeServers:
    """The servers' side of the calls ColocatedSGLang makes: pushes and memory calls, recorded."""

    def __init__(self, events):
        self.events = events

    def update_weights(self, hf_dir=None, state_dict=None, *, version=None, probe=None):
        self.events.append("push tensors" if state_dict is not None else "push folder")
        return SyncReport("memory" if state_dict is not None else "disk", 0.0, version, 0, None)

    @property
    def pool(self):  # memory_saver.release/resume post to every server of the pool
        return self

    def post_all(self, path, body, what):  # memory_saver.release/resume's one call
        self.events.append(f"{path.strip('/').split('_')[0]} " + ",".join(body["tags"]))

    def pause_probes(self):  # SGLangEngine's: no health probe in flight when the servers release their memory
        self.events.append("pause probes")

    def resume_probes(self):
        self.events.append("resume probes")


def colocated(events, warm: bool, tensors: bool) -> ColocatedSGLang:
    """Servers up (after stage 0) that released all their memory at the end of the last stage's rollout."""
    sglang = SGLangConfig(urls=("http://x",), memory_saver=True, weight_sync="memory" if tensors else "disk")
    lifecycle = ColocatedSGLang(EngineConfig(kind="sglang", sglang=sglang), log=lambda *a, **k: None)
    lifecycle.engine = FakeServers(events)
    if warm:
        lifecycle.offload()
        events.clear()
    return lifecycle


@pytest.fixture
def events():
    return Events()


@pytest.mark.parametrize("tensors", [True, False], ids=["memory-sync", "disk-sync"])
def test_colocated_refresh_offloads_the_trainer_before_the_servers_weights_return(events, tensors):
    publish(FakePolicy(events), colocated(events, warm=True, tensors=tensors), 1, Path("/x"))
    push = "push tensors" if tensors else "push folder"
    assert events == ["gather", "trainer offload + empty_cache", "resume weights", push,
                      "trainer offload + empty_cache", "resume kv_cache,cuda_graph"]


def test_first_stage_starts_its_engine_after_the_trainer_offloads(events):
    lifecycle = colocated(events, warm=False, tensors=False)
    publish(FakePolicy(events), lifecycle, 0, Path("/x"))
    assert events[:2] == ["gather", "trainer offload + empty_cache"]
    assert not any(e.startswith(("resume", "push")) for e in events)
    assert lifecycle.hf_dir == Path("/x")  # the folder the servers start from


@dataclass
class FakeRun:
    policy: FakePolicy
    plan: object
    state: object = None
    prompts: object = None
    cfg: object = None
    tokenizer: object = None
    metrics: object = None

    def export_final(self):
        return self.policy.weights(hf_dir=Path("/final"))

    sampling, evaluate = (lambda self, stage: None), Trainer.evaluate


def test_final_evaluation_runs_after_the_trainer_offloads(events, monkeypatch):
    import megamu.loop.trainer as trainer

    @dataclass
    class Plan:
        num_stages: int = 2

    @dataclass
    class State:
        update: int = 8

    @dataclass
    class Prompts:
        eval_sets: dict

    monkeypatch.setattr(trainer, "evaluate_sets", lambda engine, *a, label, **k: events.append(f"evaluate {label}"))
    @dataclass
    class Cfg:
        evaluation: object = None

    run = FakeRun(FakePolicy(events), Plan(), State(), Prompts({"held-out": [object()]}), Cfg())
    Trainer.final_evaluation(run, colocated(events, warm=True, tensors=False), scorer=None, stage=2)
    assert events == ["gather", "trainer offload + empty_cache", "resume weights", "push folder",
                      "resume kv_cache,cuda_graph", "evaluate final", "trainer onload"]


def test_probes_pause_before_the_servers_release_their_memory_and_resume_for_the_rollout(events):
    """SGLang's /release_memory_occupation asserts an idle server and /health_generate is a request: the probes are
    paused (and the one in flight drained, test_sglang_health.py) first; the next rollout turns them back on."""
    lifecycle = colocated(events, warm=False, tensors=True)
    lifecycle.offload()
    assert events == ["pause probes", "release kv_cache,weights,cuda_graph"]
    events.clear()
    lifecycle.start(1)
    assert events == ["resume probes"]
