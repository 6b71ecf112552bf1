"""Each engine lifecycle driven through 2-3 stages as megamu.loop.staged drives it (wants -> update_weights -> onload
-> start -> generate -> offload), a resume (a new lifecycle started mid-run) and the end (stop), on a fake engine that
records the calls it gets, and on the real in-process engine."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megamu.engines import EngineConfig, SGLangConfig
from megamu.engines.lifecycle import ColocatedLocal, RestartEachStage
from megamu.engines.lifecycle import base as lifecycle_base
from megamu.engines.local import LocalEngine
from megamu.engines.sglang.colocated import ColocatedSGLang
from megamu.engines.sglang.weight_sync import SyncReport
from megamu.engines.types import GenerateRequest, SamplingParams
from megamu.engines.weights import LogprobProbe, Weights
from megamu.mode import ASYNC, COLOCATED, MODES, STAGED

PROBE = LogprobProbe(token_ids=[1, 2, 3], logprobs=[-0.5, -0.25], tolerance=0.01)


class FakeEngine:
    """Records every call, into the list all engines of a test share."""

    control_urls = ("http://fake",)

    def __init__(self, calls: list, hf_dir):
        self.calls = calls
        calls.append(("start", Path(hf_dir).name))

    def generate(self, requests):
        self.calls.append(("generate",))
        return []

    def update_weights(self, hf_dir=None, state_dict=None, *, version=None, probe=None):
        self.calls.append(("push", "tensors" if state_dict is not None else Path(hf_dir).name, version,
                           "probe" if probe else None))
        return SyncReport("memory" if state_dict is not None else "disk", 0.5, str(version), 8)

    def teacher_forced_logprobs(self, token_ids, url=None):
        self.calls.append(("probe", url))
        return list(PROBE.logprobs)

    @property
    def pool(self):  # memory_saver.release/resume post to every server of the pool
        return self

    def post_all(self, path, body, what):  # the memory saver's release / resume (engines/sglang/memory_saver.py)
        self.calls.append((path.strip("/").split("_")[0], tuple(body["tags"])))

    def pause_probes(self):  # their order around the release: test_push_order.py
        pass

    def resume_probes(self):
        pass

    def shutdown(self):
        self.calls.append(("shutdown",))


@pytest.fixture
def calls(monkeypatch):
    recorded: list = []
    monkeypatch.setattr(lifecycle_base, "build_engine", lambda cfg, hf_dir: FakeEngine(recorded, hf_dir))
    return recorded


def run_stages(lifecycle, stages, probe: LogprobProbe | None = None, first: int = 0) -> list:
    """The loop's engine calls for ``stages`` stages from ``first``: the weights each stage asks for (what it got)."""
    asked = []
    for k in range(first, first + stages):
        want = lifecycle.wants()
        asked.append(want)
        weights = Weights(version=4 * k, hf_dir=Path(f"stage_{k}") if want.folder else None,
                          tensors={"w": torch.zeros(1)} if want.tensors else None,
                          probe=probe if want.probe_ids is not None else None)
        lifecycle.update_weights(weights, k)
        lifecycle.onload()
        lifecycle.start(k)
        lifecycle.serving().generate([])
        lifecycle.offload()
    return asked


def test_staged_mode_starts_an_engine_on_each_stage_folder_and_stops_it_after_the_rollout(calls):
    lifecycle = STAGED.lifecycle(EngineConfig())
    assert isinstance(lifecycle, RestartEachStage)
    asked = run_stages(lifecycle, 3)
    assert all(w.folder and not w.tensors for w in asked)
    assert calls == [("start", f"stage_{k}") if i == 0 else c for k in range(3)
                     for i, c in enumerate([None, ("generate",), ("shutdown",)])]
    assert lifecycle.engine is None  # its memory is free for the μ updates
    lifecycle.eval_engine(Weights(version=12, hf_dir=Path("final")))  # the final evaluation starts one more
    lifecycle.stop()
    assert calls[-2:] == [("start", "final"), ("shutdown",)]


def test_colocated_local_starts_once_then_pushes_tensors(calls):
    lifecycle = COLOCATED.lifecycle(EngineConfig())
    assert isinstance(lifecycle, ColocatedLocal)
    asked = run_stages(lifecycle, 3)
    assert [(w.folder, w.tensors) for w in asked] == [(True, False), (False, True), (False, True)]
    assert calls == [("start", "stage_0"), ("generate",), ("push", "tensors", 4, None), ("generate",),
                     ("push", "tensors", 8, None), ("generate",)]
    lifecycle.stop()
    assert calls[-1] == ("shutdown",) and lifecycle.engine is None


def test_colocated_local_resumed_mid_run_starts_from_the_stage_folder(calls):
    """A resumed run's lifecycle is new: its first stage starts the engine from that stage's export."""
    asked = run_stages(COLOCATED.lifecycle(EngineConfig()), 2, first=2)
    assert [w.folder for w in asked] == [True, False]
    assert calls[:3] == [("start", "stage_2"), ("generate",), ("push", "tensors", 12, None)]


def sglang_cfg(**kw) -> EngineConfig:
    return EngineConfig(kind="sglang", sglang=SGLangConfig(**kw))


def test_colocated_sglang_releases_memory_and_probes_each_push_once_the_kv_cache_is_back(calls):
    logged = []
    lifecycle = COLOCATED.lifecycle(sglang_cfg(memory_saver=True, weight_sync="memory"),
                               log=lambda kind, **f: logged.append((kind, f)), probe_ids=[1, 2, 3])
    assert isinstance(lifecycle, ColocatedSGLang)
    asked = run_stages(lifecycle, 3, probe=PROBE)
    assert [(w.folder, w.tensors, w.probe_ids) for w in asked] == [(True, False, None), (False, True, [1, 2, 3]),
                                                                   (False, True, [1, 2, 3])]
    everything = ("kv_cache", "weights", "cuda_graph")
    refresh = [("resume", ("weights",)), None, ("resume", ("kv_cache", "cuda_graph")),
               ("probe", "http://fake"), ("generate",), ("release", everything)]
    assert calls == [("start", "stage_0"), ("generate",), ("release", everything),
                     *[("push", "tensors", 4 * k, None) if c is None else c for k in (1, 2) for c in refresh]]
    assert [(k, f["stage"], f["weight_version"], f["probe_mean_abs_diff"]) for k, f in logged] == \
        [("sync", 1, "4", 0.0), ("sync", 2, "8", 0.0)]
    # servers megamu launched from stage 0's export: their restarts load it, so it is kept until the end
    assert [lifecycle.keeps_export(k) for k in range(3)] == [True, False, False]
    lifecycle.stop()
    assert calls[-1] == ("shutdown",)


def test_colocated_sglang_disk_sync_on_given_servers_pushes_folders_and_probes_at_once(calls):
    """Servers someone else runs (--sglang-url), without the memory saver: the probe runs with the push."""
    logged = []
    lifecycle = COLOCATED.lifecycle(sglang_cfg(urls=("http://given",)),
                               log=lambda kind, **f: logged.append(kind), probe_ids=[1])
    run_stages(lifecycle, 2, probe=PROBE)
    assert calls == [("start", "stage_0"), ("generate",), ("push", "stage_1", 4, "probe"), ("generate",)]
    assert logged == ["sync"] and not any(lifecycle.keeps_export(k) for k in range(2))


def test_colocated_sglang_resumed_mid_run_starts_from_the_stage_folder_and_evaluates_after_a_push(calls):
    lifecycle = COLOCATED.lifecycle(sglang_cfg(memory_saver=True))
    run_stages(lifecycle, 1, first=3)
    assert calls[0] == ("start", "stage_3") and lifecycle.keeps_export(3) and not lifecycle.keeps_export(0)
    calls.clear()
    lifecycle.eval_engine(Weights(version=16, hf_dir=Path("final")))  # the final evaluation, on the same servers
    assert calls == [("resume", ("weights",)), ("push", "final", 16, None), ("resume", ("kv_cache", "cuda_graph"))]


def test_async_mode_has_no_stage_lifecycle():
    """Its engine is a process of its own (megamu.loop.engine_process.EngineProcess), which the async loop starts."""
    with pytest.raises(ValueError, match="async"):
        ASYNC.lifecycle(EngineConfig())


def greedy(engine, prompt: list[int]) -> list[int]:
    sampling = SamplingParams(temperature=0.0, max_new_tokens=6, seed=0)
    return engine.generate([GenerateRequest(0, prompt, sampling)])[0].output_ids


@pytest.mark.parametrize("mode", ["staged", "colocated"])
def test_the_local_engine_serves_each_stage_weights(mode, tiny_llama, tiny_llama_2):
    """Stage k's rollout is generated by θ_k: two stages on two different models, checked against fresh engines."""
    lifecycle, prompt = MODES[mode].lifecycle(EngineConfig()), [5, 9, 2, 7]
    expected = [greedy(LocalEngine(d), prompt) for d in (tiny_llama, tiny_llama_2)]
    assert expected[0] != expected[1]  # the two models tell apart which one generated
    for k, folder in enumerate((tiny_llama, tiny_llama_2)):
        want = lifecycle.wants()
        tensors = dict(LocalEngine(folder).model.state_dict()) if want.tensors else None
        lifecycle.update_weights(Weights(version=k, hf_dir=Path(folder) if want.folder else None, tensors=tensors), k)
        lifecycle.onload()
        lifecycle.start(k)
        assert greedy(lifecycle.serving(), prompt) == expected[k]
        lifecycle.offload()
    lifecycle.stop()
    assert lifecycle.engine is None
