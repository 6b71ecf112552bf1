"""A colocated baseline that survives one fault (issue 50 item 5): four stages driven as megamu.loop.staged drives
them (update_weights -> onload -> start -> rollout -> offload) through the real SGLangEngine and ColocatedSGLang
against a schema server (tests/engines/schema_server.py) that fails once at refresh K. The pushes take the transport of
servers on the trainer's GPUs (tensor handles, here of CPU tensors in shared memory: test_sglang_memory_push.py), the
colocated baseline's.

Each fault is survived and proven so by what the run produced: every stage's dataset holds every (prompt, sample)
once, and the behaviour log-probs recorded at stage K are the teacher-forced log-probs of θ_K (computed here with
transformers from θ_K's folder, an independent reference), so the servers generated with the right weights after the
recovery. Faults twice in a row stop the run with an error that says so. megamu/engines/sglang/push_recovery.py says
which upstream pattern each recovery follows (slime's ``recover``, SGLang's ``/update_weights_from_disk`` roll-back);
tests/sglang_real/test_push_recovery_upstream.py pins SGLang's facts on the installed source."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest
import torch

from megamu.engines import EngineConfig, SGLangConfig
from megamu.engines.local import LocalEngine
from megamu.engines.sglang.colocated import ColocatedSGLang
from megamu.engines.sglang.launch import LOAD_BASE_S, LOAD_RATE_BYTES_S, load_seconds, model_bytes, startup_timeout
from megamu.engines.sglang.push_recovery import RECOVERY_DIR
from megamu.engines.sglang.schema import SGLangError
from megamu.engines.weights import LogprobProbe, Weights
from megamu.rollout.dataset import StageDataset
from megamu.rollout.phase import run_rollout_phase
from tests.engines.schema_server import SchemaServer
from tests.rollout.test_phase import SAMPLING, ParityScorer, make_prompts
from tests.tiny import build_char_tokenizer

K = 2  # the refresh the fault hits
PUSH = "/update_weights_from_tensor"  # one bucket per push: the tiny model is far below weight_bucket_mb
N = 2  # samples per prompt
PROBE_IDS = [1, 5, 9, 14, 3, 7, 11]


def _tensors(folder: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(Path(folder).glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def _teacher_forced(folder: str, ids: list[int]) -> list[float]:
    """log p(ids[i] | ids[:i]) for i >= 1 under the HF model in ``folder`` (transformers, fp64)."""
    from transformers import AutoModelForCausalLM

    from megamu.engines import local

    with local._LOAD_LOCK:  # from_pretrained sets torch's default dtype while it loads: not beside a server's load
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64).eval()
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, :-1]
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1).tolist()


class Run:
    """Four stages on one schema server: θ_0 = folders[0] loaded at start, θ_k pushed in memory at refresh k."""

    def __init__(self, tmp_path: Path, folders: list[str], memory_saver: bool, **cfg):
        launch = tmp_path / "exports" / "stage_0000"  # the run's stage-0 export: a recovery folder goes beside it
        shutil.copytree(folders[0], launch)
        self.tmp, self.folders = tmp_path, [str(launch), *folders[1:]]
        self.server = SchemaServer(LocalEngine(folders[0]))
        self.server.memory_saver = memory_saver
        sglang = SGLangConfig(urls=[self.server.url], api_key="secret", weight_sync="memory",
                              memory_saver=memory_saver, backoff_s=0.01, control_timeout_s=1.0,
                              server_concurrency=4, shares_trainer_devices=True, sync_backend="nccl", **cfg)
        self.logged: list[tuple[str, dict]] = []
        self.lifecycle = ColocatedSGLang(EngineConfig(kind="sglang", dtype="float32", sglang=sglang),
                                         log=lambda kind, **f: self.logged.append((kind, f)), probe_ids=PROBE_IDS)
        self.tok = build_char_tokenizer()
        self.prompts = make_prompts(self.tok)

    def stage(self, k: int, before_refresh=None) -> None:
        folder = self.folders[k % len(self.folders)]
        if k == 0:
            weights = Weights(version=0, hf_dir=Path(folder))
        else:
            probe = LogprobProbe(PROBE_IDS, _teacher_forced(folder, PROBE_IDS), tolerance=1e-4)
            weights = Weights(version=k, tensors=_tensors(folder), probe=probe)
        if before_refresh is not None:
            before_refresh(self.server)
        self.lifecycle.update_weights(weights, k)
        del weights
        self.lifecycle.onload()
        self.lifecycle.start(k)
        run_rollout_phase(self.lifecycle.serving(), self.prompts, self.tmp / f"stage_{k}", sampling=SAMPLING,
                          n_samples=N, scorer=ParityScorer(), tokenizer=self.tok, stage=k, groups_per_shard=2)
        self.lifecycle.offload()

    def check_stage(self, k: int) -> None:
        """Every (prompt, sample) once, and the behaviour log-probs are θ_k's (transformers' reference, fp64; the
        server computes in fp32 over ~30 tokens: 1e-4 is ~100x its rounding)."""
        samples = StageDataset(self.tmp / f"stage_{k}").samples()
        keys = [(s.prompt_id, s.sample_index) for s in samples]
        assert sorted(keys) == sorted((p.prompt_id, j) for p in self.prompts for j in range(N))
        folder = self.folders[k % len(self.folders)]
        for s in samples[:3]:
            ids = list(s.prompt_ids) + list(s.response_ids)
            want = _teacher_forced(folder, ids)[len(s.prompt_ids) - 1:]
            torch.testing.assert_close(torch.tensor(list(s.behaviour_logprobs), dtype=torch.float64),
                                       torch.tensor(want, dtype=torch.float64), atol=1e-4, rtol=0)

    def syncs(self) -> list[tuple[int, str]]:
        return [(f["stage"], f["weight_version"]) for kind, f in self.logged if kind == "sync"]

    def faults(self) -> list[tuple[int, str]]:
        return [(f["stage"], f["action"]) for kind, f in self.logged if kind == "sync_fault"]

    def close(self) -> None:
        self.lifecycle.stop()
        self.server.close()


@pytest.fixture
def folders(tiny_llama, tiny_llama_2):
    return [tiny_llama, tiny_llama_2]


def _survive(tmp_path, folders, inject, memory_saver: bool) -> Run:
    run = Run(tmp_path, folders, memory_saver)
    try:
        for k in range(4):
            run.stage(k, inject if k == K else None)
        for k in range(4):
            run.check_stage(k)
        assert run.syncs() == [(1, "1"), (2, "2"), (3, "3")]  # one sync record per refresh
    finally:
        run.close()
    return run


@pytest.mark.parametrize("path,fault", [("/release_memory_occupation", "503"),
                                        ("/resume_memory_occupation", "drop")])
def test_a_control_call_that_fails_is_sent_again(tmp_path, folders, path, fault):
    def inject(server):
        server.path_faults[path] = [fault]

    run = _survive(tmp_path, folders, inject, memory_saver=True)
    sent = [c for c in run.server.calls if c.startswith(path)]
    # without a fault: a release at each of the 4 stages' ends, two resumes (weights, then the cache) per refresh
    assert len(sent) == {"/release_memory_occupation": 4, "/resume_memory_occupation": 6}[path] + 1
    assert not run.server.path_faults[path] and not run.faults()  # retried inside the call: no push fault


def test_a_disk_reload_that_times_out_is_sent_again(tmp_path, folders, monkeypatch):
    """The reload after two failed pushes waits its bound (here 1 s: the model's load time patched to 0), gets no
    answer (the load is slow; SGLang's scheduler runs it before anything sent after it), and is sent again: loading
    the same folder twice ends in the same state."""
    from megamu.engines.sglang import server_weights

    monkeypatch.setattr(server_weights, "load_seconds", lambda nbytes: 0.0)

    def inject(server):
        server.path_faults[PUSH] = ["fail", "fail"]
        server.path_faults["/update_weights_from_disk"] = ["slow:1.5"]

    run = _survive(tmp_path, folders, inject, memory_saver=False)
    assert run.server.calls.count(f"/update_weights_from_disk@{K}") == 2  # (@1: the given server's start)
    assert [a for _, a in run.faults()] == ["push failed: pushing again", "push failed again: reloading the servers "
                                            "from an HF export of the same weights"]


def test_a_memory_call_that_times_out_is_not_sent_twice(tmp_path, folders):
    """A resume still running when its wait ends would be applied twice by a second one (SGLang's scheduler removes
    the tag it resumes: a KeyError the second time), and a second request would only queue behind a hung first: the
    run stops, naming the call and the bound."""
    run = Run(tmp_path, folders, memory_saver=True)
    try:
        run.stage(0)
        run.server.path_faults["/resume_memory_occupation"] = ["sleep:1.5"]
        with pytest.raises(SGLangError, match=r"resuming weights on http://127.0.0.1:\d+: no answer .* within 1.0s"):
            run.stage(1)
        assert [c for c in run.server.calls if c.startswith("/resume")] == ["/resume_memory_occupation:weights"]
    finally:
        run.close()


def test_a_push_that_fails_once_is_pushed_again(tmp_path, folders):
    def inject(server):
        server.path_faults[PUSH] = ["fail"]

    run = _survive(tmp_path, folders, inject, memory_saver=False)
    assert run.faults() == [(K, "push failed: pushing again")]
    assert [c for c in run.server.calls if c.startswith(PUSH)] == [f"{PUSH}@{k}" for k in (1, K, K, 3)]


def test_a_push_that_fails_twice_reloads_the_same_weights_from_an_export(tmp_path, folders):
    def inject(server):
        server.path_faults[PUSH] = ["fail", "fail"]

    run = _survive(tmp_path, folders, inject, memory_saver=False)
    assert run.faults() == [(K, "push failed: pushing again"),
                            (K, "push failed again: reloading the servers from an HF export of the same weights")]
    assert f"/update_weights_from_disk@{K}" in run.server.calls
    export = tmp_path / "exports" / RECOVERY_DIR / f"stage_{K:04d}"
    assert export.is_dir() and (export / "config.json").is_file()
    reloaded = _tensors(str(export))
    want = _tensors(folders[K % 2])
    assert reloaded.keys() == want.keys() and all(torch.equal(reloaded[n], want[n]) for n in want)


@pytest.mark.parametrize("memory_saver", [False, True], ids=["probe-at-push", "probe-after-onload"])
def test_a_probe_mismatch_is_pushed_again_once(tmp_path, folders, memory_saver):
    def inject(server):
        server.path_faults[PUSH] = ["corrupt"]

    run = _survive(tmp_path, folders, inject, memory_saver=memory_saver)
    assert run.faults() == [(K, "probe mismatch: pushing again")]


def test_a_probe_mismatch_twice_stops_the_run_saying_so(tmp_path, folders):
    run = Run(tmp_path, folders, memory_saver=False)
    try:
        run.stage(0)
        run.stage(1)
        run.server.path_faults[PUSH] = ["corrupt", "corrupt"]
        with pytest.raises(SGLangError, match="differ from the trainer's after the push and again after a second"):
            run.stage(K)
        assert run.faults() == [(K, "probe mismatch: pushing again")] and run.syncs() == [(1, "1")]
    finally:
        run.close()


def test_a_failed_reload_stops_the_run_and_control_retries_are_bounded(tmp_path, folders):
    run = Run(tmp_path, folders, memory_saver=True, max_retries=2)
    try:
        run.stage(0)
        run.stage(1)
        run.server.path_faults[PUSH] = ["fail", "fail"]
        run.server.path_faults["/update_weights_from_disk"] = ["fail"]
        with pytest.raises(SGLangError, match="could not reload the same weights from disk: stopping"):
            run.stage(K)
        run.server.path_faults["/resume_memory_occupation"] = ["503"] * 3  # one more than max_retries allows
        t0 = time.monotonic()
        with pytest.raises(SGLangError, match="failed after 3 attempts"):
            run.lifecycle.onload()
        assert time.monotonic() - t0 < 5  # backoff 0.01 s, 0.02 s: bounded by max_retries, not by a clock
    finally:
        run.close()


def test_the_startup_timeout_is_scaled_to_the_model(tiny_llama):
    """LOAD_BASE_S + safetensors bytes at LOAD_RATE_BYTES_S, unless --sglang-startup-timeout is given. A 57 GiB
    model: 300 s + 584 s, where the old fixed 600 s would cut a cold load short."""
    nbytes = model_bytes(tiny_llama)
    assert nbytes == sum(p.stat().st_size for p in Path(tiny_llama).glob("*.safetensors")) > 0
    assert startup_timeout(SGLangConfig(), tiny_llama) == LOAD_BASE_S + nbytes / LOAD_RATE_BYTES_S
    assert startup_timeout(SGLangConfig(startup_timeout_s=42.0), tiny_llama) == 42.0
    assert round(load_seconds(57 * 2**30)) == 300 + round(57 * 1024 / 100)
    assert startup_timeout(SGLangConfig(), None) == LOAD_BASE_S


# ---- the per-rank push (servers on the trainer's GPUs over several nodes): its retry decisions, on one rank ---------

class FakePusher:
    """RankPush's place: each rank's push, failing its first ``fails`` calls."""

    def __init__(self, fails: int):
        self.fails, self.calls = fails, 0

    def push(self, tensors, version) -> int:
        self.calls += 1
        if self.calls <= self.fails:
            raise RuntimeError("http://s:1/update_weights_from_tensor failed: injected")
        return 8

    def close(self) -> None:
        pass


class FakeRankZeroEngine:
    """Rank 0's engine after the ranks pushed: it confirms (adopt_weights), reloads from disk, or pushes again."""

    def __init__(self, probe_fails: int = 0, disk_fails: int = 0):
        self.calls: list[tuple] = []
        self.probe_fails, self.disk_fails = probe_fails, disk_fails

    def adopt_weights(self, version, probe=None):
        from megamu.engines.sglang.weight_sync import ProbeMismatch, SyncReport

        self.calls.append(("adopt", str(version), probe is not None))
        if probe is not None and self.probe_fails:
            self.probe_fails -= 1
            raise ProbeMismatch("server http://s:1: server log-probs differ from the trainer's")
        return SyncReport("confirm", 0.0, str(version), 0, 0.0 if probe is not None else None)

    def update_weights(self, hf_dir=None, state_dict=None, *, version=None, probe=None):
        from megamu.engines.sglang.weight_sync import SyncReport

        self.calls.append(("disk" if hf_dir is not None else "tensors", str(version), probe is not None))
        if hf_dir is not None and self.disk_fails:
            self.disk_fails -= 1
            raise SGLangError(f"weight update from {hf_dir} on http://s:1: refused: HTTP 400", status=400)
        return SyncReport("disk" if hf_dir else "memory", 0.0, str(version), 0, 0.0 if probe is not None else None)


def _per_rank(tmp_path, tiny_llama, fails: int, probe_fails: int = 0, disk_fails: int = 0):
    launch = tmp_path / "exports" / "stage_0000"
    shutil.copytree(tiny_llama, launch)
    logged: list[tuple[str, dict]] = []
    lifecycle = ColocatedSGLang(EngineConfig(kind="sglang", sglang=SGLangConfig(
        urls=["http://s:1"], weight_sync="memory", memory_saver=False)), log=lambda k, **f: logged.append((k, f)))
    lifecycle.every_node, lifecycle.warm, lifecycle.hf_dir = True, True, launch
    lifecycle.pusher, lifecycle.engine = FakePusher(fails), FakeRankZeroEngine(probe_fails, disk_fails)
    probe = LogprobProbe(PROBE_IDS, [0.0] * (len(PROBE_IDS) - 1), tolerance=1e-4)
    lifecycle.update_weights(Weights(version=K, tensors=_tensors(tiny_llama), probe=probe), K)
    return lifecycle, [(f["stage"], f["action"]) for k, f in logged if k == "sync_fault"], \
        [(f["stage"], f["weight_version"]) for k, f in logged if k == "sync"]


def test_per_rank_pushes_survive_one_fault_each(tmp_path, tiny_llama):
    once, faults, syncs = _per_rank(tmp_path / "once", tiny_llama, fails=1)
    assert once.pusher.calls == 2 and once.engine.calls == [("adopt", "2", True)]
    assert faults == [(K, "push failed: pushing again")] and syncs == [(K, "2")]

    twice, faults, syncs = _per_rank(tmp_path / "twice", tiny_llama, fails=2)
    assert twice.pusher.calls == 2 and twice.engine.calls == [("disk", "2", True), ("adopt", "2", False)]
    assert faults == [(K, "push failed: pushing again"), (K, "push failed again")] and syncs == [(K, "2")]
    export = tmp_path / "twice" / "exports" / RECOVERY_DIR / f"stage_{K:04d}"
    assert _tensors(str(export)).keys() == _tensors(tiny_llama).keys()

    probed, faults, syncs = _per_rank(tmp_path / "probe", tiny_llama, fails=0, probe_fails=1)
    assert probed.engine.calls == [("adopt", "2", True), ("tensors", "2", True)]
    assert faults == [(K, "probe mismatch: pushing again")] and syncs == [(K, "2")]


def test_per_rank_pushes_whose_reload_fails_stop_saying_so(tmp_path, tiny_llama):
    with pytest.raises(SGLangError, match="failed twice and the servers could not reload the same weights from disk"):
        _per_rank(tmp_path, tiny_llama, fails=2, disk_fails=1)


def test_a_recovery_export_that_is_not_whole_is_never_handed_to_a_server(tmp_path, monkeypatch):
    """A shard cut short on disk (a full disk, a lost write) stops the recovery with an OSError (a push fault) before
    any server is told to load it: SGLang's own roll-back reloads the same folder and its scheduler dies
    (push_recovery's docstring); the folder is not renamed into place."""
    import megamu.convert.io as io
    from megamu.engines.sglang.push_recovery import write_recovery_export

    launch = tmp_path / "hf" / "stage_0000"
    launch.mkdir(parents=True)
    (launch / "config.json").write_text("{}")
    tensors = {"a.weight": torch.randn(64, 32), "b.weight": torch.randn(16)}
    assert write_recovery_export(tensors, launch, stage=1).name == "stage_0001"  # whole: taken

    written = io.write_sharded

    def cut_short(items, folder, *rest, **kw):
        out = written(items, folder, *rest, **kw)
        (shard,) = folder.glob("*.safetensors")
        shard.write_bytes(shard.read_bytes()[:-100])
        return out

    monkeypatch.setattr(io, "write_sharded", cut_short)
    with pytest.raises(OSError, match="not whole .* files shorter than their headers: \\['model"):
        write_recovery_export(tensors, launch, stage=2)
    assert not (tmp_path / "hf" / RECOVERY_DIR / "stage_0002").exists()
