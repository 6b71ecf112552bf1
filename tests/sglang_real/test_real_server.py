"""megamu's SGLang engine against the real SGLang 0.5.23 server (CPU build), launched by megamu itself.

References are independent of the server: transformers' teacher-forced log_softmax(logits / T) of the same tokens.
Tolerances: both sides compute in float32 on a 2-layer model with hidden size 64 and a vocabulary of 101, so log-probs
agree to a few float32 ulps of values of size ~10 (~1e-5); 1e-4 leaves room for other CPUs' kernels and reductions.
"""

import contextlib
import json
import os
import subprocess
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from megamu.engines.sglang.client import SGLangEngine, SGLangError
from megamu.engines.sglang.weight_sync import LogprobProbe, WeightMismatch
from megamu.engines.types import GenerateRequest, PromptError, SamplingParams
from tests.processes import group_members, pid_alive
from tests.sglang_real.cpu_build import API_KEY, cpu_config
from tests.tiny import save_tiny_model
from tests.torchrun import server_ports

ATOL = 1e-4


class Served:
    """The module's server and the folder of the weights it runs now (weight-sync tests move it)."""

    def __init__(self, engine: SGLangEngine, model_dir: str):
        self.engine, self.model_dir, self.model_dir_base = engine, model_dir, model_dir
        self._models = {}

    def model(self, model_dir: str | None = None):
        d = model_dir or self.model_dir
        if d not in self._models:
            self._models[d] = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
        return self._models[d]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("sglang_real")
    model_dir = str(save_tiny_model(root / "base", "llama", seed=0))
    engine = SGLangEngine(model_dir, cpu_config(server_ports(), root / "logs"))
    leaders = engine.pids
    members = [m for pid in leaders for m in group_members(pid)]
    yield Served(engine, model_dir)
    engine.shutdown()
    # Shutdown leaves no process behind: not the servers, nor their scheduler / detokenizer children.
    deadline = time.monotonic() + 10
    while any(pid_alive(p) for p in members) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert members and not [p for p in members if pid_alive(p)]


def teacher_forced(model, prompt, output, temperature=1.0):
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output])).logits[0, len(prompt) - 1 : -1].double()
    return torch.log_softmax(logits / temperature, -1).gather(1, torch.tensor(output)[:, None]).squeeze(1)


def test_megamu_launched_the_server_under_another_python(served):
    engine = served.engine
    assert engine.launched and len(engine.pids) == 1
    with open(f"/proc/{engine.pids[0]}/cmdline", "rb") as f:
        cmd = f.read().split(b"\0")
    assert cmd[0].decode() == engine.config.server_python and b"--dtype" in cmd and b"float32" in cmd
    with open(f"/proc/{engine.pids[0]}/environ", "rb") as f:
        env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
    assert env[b"SGLANG_USE_CPU_ENGINE"] == b"1" and b"RANK" not in env and b"MASTER_ADDR" not in env
    assert engine.vocab_size == 101 and engine.max_input_len and engine.server_dtype == "float32"
    with pytest.raises(SGLangError, match="rejected the API key"):  # the server really checks the key we gave it
        SGLangEngine(None, urls=engine.urls, api_key=API_KEY + "-wrong", startup_timeout_s=30)


@pytest.mark.parametrize("temperature,top_p,top_k", [(1.0, 1.0, 0), (0.7, 0.9, 20)])
def test_logprobs_match_transformers_and_groups(served, temperature, top_p, top_k):
    sp = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, max_new_tokens=12, n=3, seed=1)
    reqs = [GenerateRequest(10 + i, [5 + i, 9, 14, 20 + i], sp) for i in range(3)]
    out = served.engine.generate(reqs)
    assert [(s.prompt_id, s.sample_index) for s in out] == [(r.prompt_id, j) for r in reqs for j in range(3)]
    for r in reqs:
        group = [s for s in out if s.prompt_id == r.prompt_id]
        assert len({tuple(s.output_ids) for s in group}) > 1  # n samples, not one copied n times
        for s in group:
            assert len(s.output_ids) == len(s.output_logprobs) > 0
            expected = teacher_forced(served.model(), r.prompt_ids, s.output_ids, temperature)
            torch.testing.assert_close(torch.tensor(s.output_logprobs, dtype=torch.float64), expected, atol=ATOL,
                                       rtol=0)


def test_stop_tokens_and_finish_reasons(served):
    prompt = [7, 30, 31, 40]
    greedy = SamplingParams(temperature=0.0, max_new_tokens=6)
    ref = served.engine.generate([GenerateRequest(0, prompt, greedy)])[0]
    assert ref.finish_reason == "length" and len(ref.output_ids) == 6
    # The model's greedy continuation, cut at its third token by making that token a stop token.
    stop = ref.output_ids[2]
    first = ref.output_ids.index(stop)
    s = served.engine.generate([GenerateRequest(0, prompt, SamplingParams(temperature=0.0, max_new_tokens=6,
                                                                         stop_token_ids=[stop]))])[0]
    assert s.finish_reason == "stop" and s.output_ids == ref.output_ids[: first + 1]  # the stop token is kept
    # A stop on the last allowed token is complete: "stop", not "length".
    s = served.engine.generate([GenerateRequest(0, prompt, SamplingParams(temperature=0.0, max_new_tokens=first + 1,
                                                                         stop_token_ids=[stop]))])[0]
    assert s.finish_reason == "stop" and len(s.output_ids) == first + 1


def test_bad_prompts_are_refused_before_sending_and_the_server_survives(served):
    engine = served.engine
    sp = SamplingParams(max_new_tokens=4)
    bad = [GenerateRequest(3, [], sp, source="a.jsonl: row 4"),
           GenerateRequest(4, [5, 101], sp, source="a.jsonl: row 5"),
           GenerateRequest(5, [5] * engine.max_input_len, sp, source="b.jsonl: row 1"),
           GenerateRequest(6, [5, 6], sp)]
    with pytest.raises(PromptError) as e:
        engine.generate(bad)
    msg = str(e.value)
    assert "3 prompt(s)" in msg and "prompt 3 (a.jsonl: row 4): empty" in msg
    assert "prompt 4 (a.jsonl: row 5): token id 101 outside" in msg and "prompt 5 (b.jsonl: row 1)" in msg
    assert "prompt 6" not in msg
    # The one the server itself refuses (over its input limit) is a 4xx: reported with the prompt, never retried.
    t0 = time.monotonic()
    with pytest.raises(SGLangError, match=r"prompt 5 \(b.jsonl: row 1\): refused: .*HTTP 400") as e:
        engine.submit(0, bad[2]).result()
    assert e.value.status == 400 and time.monotonic() - t0 < engine.config.backoff_s + 5
    assert len(engine.generate([bad[3]])) == 1  # and the server still answers


def test_rollout_phase_streams_shards(served, tmp_path):
    from megamu.data.prompts import PromptRecord
    from megamu.rollout.dataset import StageDataset
    from megamu.rollout.phase import run_rollout_phase
    from tests.tiny import build_char_tokenizer

    class LengthScorer:
        def score(self, responses, truths):
            return [float(len(r) % 3 == 0) for r in responses]

    prompts = [PromptRecord(i, [5 + i % 50, 9, 14], "0", "") for i in range(10)]
    sp = SamplingParams(temperature=1.0, max_new_tokens=8, seed=3)
    m = run_rollout_phase(served.engine, prompts, tmp_path / "stage", sampling=sp, n_samples=2, scorer=LengthScorer(),
                          tokenizer=build_char_tokenizer(), stage=0, groups_per_shard=3, max_in_flight=4)
    ds = StageDataset(tmp_path / "stage")
    assert m.num_shards == 4 and ds.num_groups == 10 and m.engine == "sglang"
    for g, p in zip(ds.groups(), prompts):
        assert [s.prompt_id for s in g] == [p.prompt_id] * 2 and [s.sample_index for s in g] == [0, 1]
        for s in g:
            expected = teacher_forced(served.model(), p.prompt_ids, s.response_ids)
            torch.testing.assert_close(torch.tensor(s.behaviour_logprobs, dtype=torch.float64), expected, atol=ATOL,
                                       rtol=0)


def _probe(model_dir, served):
    ids = [5, 9, 14, 20, 33, 41, 50, 61]
    lp = teacher_forced(served.model(model_dir), ids[:1], ids[1:]).tolist()
    return LogprobProbe(ids, lp, tolerance=ATOL)


def test_disk_sync_checks_layout_sets_version_and_probes(served, tmp_path):
    engine = served.engine
    other = str(save_tiny_model(tmp_path / "other", "llama", seed=5))
    report = engine.update_weights(hf_dir=other, version=3, probe=_probe(other, served))
    served.model_dir = other
    assert (report.mode, report.version, engine.weight_version) == ("disk", "3", "3")
    assert report.probe_mean_abs_diff <= ATOL
    sp = SamplingParams(temperature=1.0, max_new_tokens=6, n=2)
    for s in engine.generate([GenerateRequest(0, [5, 6, 7], sp)]):
        assert s.weight_version == "3"
        torch.testing.assert_close(torch.tensor(s.output_logprobs, dtype=torch.float64),
                                   teacher_forced(served.model(), [5, 6, 7], s.output_ids), atol=ATOL, rtol=0)
    # A probe the served weights do not reproduce (log-probs of the wrong model) is caught.
    with pytest.raises(WeightMismatch, match="probe token"):
        engine.update_weights(hf_dir=other, version=4, probe=_probe(served.model_dir_base, served))


def test_mismatched_weights_are_refused(served, tmp_path):
    engine = served.engine
    before = engine.weight_version
    qwen = save_tiny_model(tmp_path / "qwen3", "qwen3", seed=2)
    with pytest.raises(WeightMismatch, match="architecture .*Qwen3ForCausalLM.* runs .*LlamaForCausalLM"):
        engine.update_weights(hf_dir=str(qwen))
    wide = save_tiny_model(tmp_path / "wide", "llama", seed=2, intermediate_size=128)
    with pytest.raises(WeightMismatch, match=r"down_proj.weight has shape \[64, 128\], the running model \[64, 96\]"):
        engine.update_weights(hf_dir=str(wide))
    sd = served.model().state_dict()
    with pytest.raises(WeightMismatch, match="is bfloat16, the server runs float32"):
        engine.update_weights(state_dict={k: v.to(torch.bfloat16) for k, v in sd.items()})
    with pytest.raises(WeightMismatch, match="tensor model.norm.weight of the running model is missing"):
        engine.update_weights(state_dict={k: v for k, v in sd.items() if k != "model.norm.weight"})
    assert engine.weight_version == before  # nothing was sent


@contextlib.contextmanager
def small_buckets(engine, mb: float = 0.02):
    """Several buckets for a 0.1 MB model. The config is frozen: the engine and its pool (which share it) get a copy
    for the test, and the module's engine gets its own back after."""
    config = engine.config
    engine.config = engine.pool.config = replace(config, weight_bucket_mb=mb)
    try:
        yield
    finally:
        engine.config = engine.pool.config = config


def test_memory_sync_matches_the_new_weights(served, tmp_path):
    engine = served.engine
    new_dir = str(save_tiny_model(tmp_path / "mem", "llama", seed=11))
    state = served.model(new_dir).state_dict()
    with small_buckets(engine):
        report = engine.update_weights(state_dict=state, version=7, probe=_probe(new_dir, served))
    served.model_dir = new_dir
    assert (report.mode, report.version) == ("memory", "7") and report.probe_mean_abs_diff <= ATOL
    assert report.bytes == sum(t.numel() * t.element_size() for t in state.values())
    out = engine.generate([GenerateRequest(1, [8, 9, 10], SamplingParams(temperature=1.0, max_new_tokens=8, n=2))])
    for s in out:
        assert s.weight_version == "7"
        torch.testing.assert_close(torch.tensor(s.output_logprobs, dtype=torch.float64),
                                   teacher_forced(served.model(), [8, 9, 10], s.output_ids), atol=ATOL, rtol=0)
    # A second sync reuses the process group, and the version moves on by one when not given.
    group = engine.sync.group
    engine.update_weights(state_dict=state)
    assert engine.sync.group is group and engine.weight_version == "8"


def test_tensor_payload_is_what_sglang_reads(tmp_path):
    """A tensor push's payload, read back by SGLang 0.5.23's own code (its restricted unpickler and
    FlattenedTensorBucket) in the CPU build's interpreter: every tensor bitwise."""
    import subprocess

    from megamu.engines.sglang.tensor_sync import serialize_bucket
    from tests.sglang_real.cpu_build import sglang_cpu_paths

    named = [("x.weight", torch.randn(4, 6)), ("y.bias", torch.arange(5, dtype=torch.float32))]
    payload, keep = serialize_bucket(named)
    torch.save(dict(named), tmp_path / "want.pt")
    (tmp_path / "payload.b64").write_text(payload)
    reader = """
import sys, torch
from sglang.srt.utils import MultiprocessingSerializer
from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions
from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket, FlattenedTensorMetadata
monkey_patch_torch_reductions()
obj = MultiprocessingSerializer.deserialize(open(sys.argv[1]).read())
meta = [FlattenedTensorMetadata(m.name, m.shape, m.dtype, m.start_idx, m.end_idx, m.numel) for m in obj["metadata"]]
got = dict(FlattenedTensorBucket(flattened_tensor=obj["flattened_tensor"], metadata=meta).reconstruct_tensors())
want = torch.load(sys.argv[2])
assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want), (got, want)
print("ok", len(got))
"""
    venv, _ = sglang_cpu_paths()
    out = subprocess.run([str(venv / "bin" / "python"), "-c", reader, str(tmp_path / "payload.b64"),
                          str(tmp_path / "want.pt")], capture_output=True, text=True, timeout=300)
    del keep
    assert out.returncode == 0 and out.stdout.split() == ["ok", "2"], out.stdout + out.stderr[-3000:]


def test_tensor_push_into_the_server(served, tmp_path):
    """/update_weights_from_tensor, the colocated transport, against the CPU build: buckets inside a weight-update
    session, then the served log-probs match the pushed weights'."""
    from megamu.engines.sglang.tensor_sync import send_tensors
    from megamu.engines.sglang.weight_sync import check_probe

    engine = served.engine
    new_dir = str(save_tiny_model(tmp_path / "tensor", "llama", seed=13))
    state = served.model(new_dir).state_dict()
    with small_buckets(engine):
        assert send_tensors(engine.pool, state, "21") == sum(t.numel() * t.element_size() for t in state.values())
    served.model_dir = new_dir
    assert check_probe(engine, _probe(new_dir, served)) <= ATOL
    engine.weight_version = "21"
    for s in engine.generate([GenerateRequest(2, [8, 9, 10], SamplingParams(temperature=1.0, max_new_tokens=6))]):
        assert s.weight_version == "21"


def test_two_stage_run_against_the_server(served, tmp_path):
    """pretrain_mu_grpo.py with --sglang-url: each stage's export is checked against the running model and loaded
    from disk; θ = β at each stage's first update (ratio 1) shows server, converter and trainer agree."""
    from tests.e2e.runs import MU, flags, launch, records

    save = tmp_path / "run"
    launch(flags(served.model_dir_base, save, "--rollout-engine", "sglang", "--sglang-url", served.engine.urls[0]),
           env={"SGLANG_API_KEY": API_KEY})
    updates = records(save, "update")
    assert len(updates) == 2 * MU
    for first in (updates[0], updates[MU]):
        assert first["ratio_mean"] == pytest.approx(1.0, abs=1e-3)
    for stage in (0, 1):
        manifest = json.loads((save / "rollouts" / f"stage_{stage}" / "manifest.json").read_text())
        assert manifest["engine"] == "sglang"


def test_colocated_grpo_run_syncs_in_memory(served, tmp_path):
    """--rollout-mode colocated with SGLang: after the first stage the weights go over in memory (no per-refresh
    export), each refresh is probed against the trainer's own log-probs, and the stage starts at ratio 1."""
    from tests.e2e.runs import MU, flags, launch, records

    save = tmp_path / "run"
    launch(flags(served.model_dir_base, save, "--rollout-engine", "sglang", "--sglang-url", served.engine.urls[0],
                 "--rollout-mode", "colocated"), env={"SGLANG_API_KEY": API_KEY})
    updates = records(save, "update")
    for first in (updates[0], updates[MU]):
        assert first["ratio_mean"] == pytest.approx(1.0, abs=1e-3)
    syncs = records(save, "sync")
    assert [(s["stage"], s["mode"], s["weight_version"]) for s in syncs] == [(1, "memory", str(MU))]
    assert syncs[0]["probe_mean_abs_diff"] <= 1e-3 and syncs[0]["bytes"] > 0
    # stage 0's export (the server's first load) is pruned once D_0 is durable; a refresh writes none
    assert not (save / "hf" / "stage_0").exists() and not (save / "hf" / "stage_1").exists()
    assert (save / "hf" / "final" / "config.json").exists()


def test_evaluate_tool_serves_bf16_exports_in_bfloat16(served, tmp_path):
    """tools/evaluate.py with servers it launches, on two bf16 exports: the servers start in the checkpoints' dtype
    (not float32, which would refuse the second export's bf16 tensors at its layout check)."""
    import sys

    from tests.sglang_real.cpu_build import CPU_SERVER_ARGS, sglang_cpu_paths

    run = tmp_path / "run"
    for stage, seed in ((0, 1), (1, 2)):
        model = AutoModelForCausalLM.from_pretrained(save_tiny_model(tmp_path / f"m{seed}", "llama", seed=seed))
        model.to(torch.bfloat16).save_pretrained(run / "hf" / f"stage_{stage}")
        AutoTokenizer.from_pretrained(tmp_path / f"m{seed}").save_pretrained(run / "hf" / f"stage_{stage}")
    (run / "metrics.jsonl").write_text("")
    venv, cpu_dir = sglang_cpu_paths()
    data = Path(__file__).resolve().parents[3] / "shared" / "data" / "amc23.jsonl"
    if not data.exists():
        data = tmp_path / "tiny.jsonl"
        data.write_text('{"problem": "1+1", "answer": "2"}\n{"problem": "2+2", "answer": "4"}\n')
    cmd = [sys.executable, str(Path(__file__).resolve().parents[2] / "tools" / "evaluate.py"), "--run", str(run),
           "--data", f"amc={data}", "--samples", "amc=2", "--limit", "2", "--max-response-len", "8",
           "--max-prompt-length", "4096", "--rollout-engine", "sglang", "--sglang-python", str(venv / "bin" / "python"),
           "--sglang-env", f"SGLANG_USE_CPU_ENGINE=1 PYTHONPATH={cpu_dir / 'stubs'}",
           "--sglang-server-args", CPU_SERVER_ARGS, "--reward-workers", "1"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900,
                          env={**os.environ, "SGLANG_API_KEY": API_KEY})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    summary = json.loads((run / "eval" / "summary.json").read_text())
    assert [c["name"] for c in summary["checkpoints"]] == ["stage_0", "stage_1"]
