"""SGLangEngine's checks against the schema server: prompts refused before sending, 4xx never retried, weight
versions, weight layouts; launch settings; the streamed rollout phase; the pieces of an in-memory sync."""

import pytest
import torch

from megamu.engines.local import LocalEngine
from megamu.engines.sglang.client import SGLangEngine, SGLangError
from megamu.engines.sglang.launch import SGLangConfig, server_command, server_env
from megamu.engines.sglang.weight_sync import (
    LogprobProbe,
    ModelLayout,
    WeightMismatch,
    buckets,
    check_layout,
    compare_probe,
    flatten,
)
from megamu.engines.types import EngineBase, GenerateRequest, PromptError, SamplingParams
from tests.tiny import save_tiny_model


def _client(server, **kw):
    return SGLangEngine(None, urls=[server.url], **dict(dict(api_key="secret", backoff_s=0.05, max_retries=3), **kw))


def test_bad_prompts_are_refused_before_anything_is_sent(server):
    server.max_req_input_len = 64
    client = _client(server)
    sp = SamplingParams(max_new_tokens=3)
    reqs = [GenerateRequest(0, [5, 6], sp, source="p.jsonl: row 1"),
            GenerateRequest(1, [], sp, source="p.jsonl: row 2"),
            GenerateRequest(2, [5, 101, 7], sp, source="p.jsonl: row 3"), GenerateRequest(3, [5, -1], sp),
            GenerateRequest(4, [5] * 64, sp, source="q.jsonl: row 9"), GenerateRequest(5, [5] * 63, sp)]
    with pytest.raises(PromptError) as e:
        client.generate(reqs)
    lines = str(e.value).splitlines()
    assert lines[0] == "4 prompt(s) refused before generation:"
    assert lines[1:] == ["  prompt 1 (p.jsonl: row 2): empty prompt",
                         "  prompt 2 (p.jsonl: row 3): token id 101 outside the model's vocabulary [0, 101)",
                         "  prompt 3: token id -1 outside the model's vocabulary [0, 101)",
                         "  prompt 4 (q.jsonl: row 9): 64 prompt tokens, the server's limit is 63 "
                         "(max_req_input_len 64)"]
    assert not server.log and not server.rids  # nothing was sent, not even the good ones


def test_a_4xx_is_reported_with_its_prompt_and_never_retried(server):
    client = _client(server, max_retries=5)
    server.faults = ["400"]
    with pytest.raises(SGLangError, match=r"prompt 7 \(f.jsonl: row 8\): refused: .*HTTP 400") as e:
        client.generate([GenerateRequest(7, [5, 6], SamplingParams(max_new_tokens=3, n=2), source="f.jsonl: row 8")])
    assert e.value.status == 400 and len(server.rids) == 2 and not server.faults  # one attempt (2 sample ids)


def test_weight_version_set_on_sync_and_checked_on_samples(server, tiny_llama, tmp_path):
    client = _client(server)
    other = save_tiny_model(tmp_path / "other", "llama", seed=5)
    report = client.update_weights(hf_dir=str(other), version=12)
    assert (report.mode, report.version, client.weight_version, server.weight_version) == ("disk", "12", "12", "12")
    out = client.generate([GenerateRequest(0, [5, 6], SamplingParams(max_new_tokens=3, n=2))])
    assert [s.weight_version for s in out] == ["12", "12"]
    assert client.update_weights(hf_dir=str(other)).version == "13"  # one more than the last when not given
    server.weight_version = "11"  # a server that was not synced (or was synced by someone else)
    with pytest.raises(SGLangError, match="made by weight version 11, but the servers were synced to 13"):
        client.generate([GenerateRequest(0, [5, 6], SamplingParams(max_new_tokens=3))])


def test_disk_sync_of_another_model_is_refused_before_sending(server, tiny_llama, tmp_path):
    client = _client(server)
    qwen = save_tiny_model(tmp_path / "qwen2", "qwen2", seed=1)
    with pytest.raises(WeightMismatch, match=r"architecture \['Qwen2ForCausalLM'\] but the server runs "
                                             r"\['LlamaForCausalLM'\]"):
        client.update_weights(hf_dir=str(qwen))
    assert server.engine.hf_dir == tiny_llama and client.weight_version == "default"


def test_layout_checks_name_the_first_mismatch(tiny_llama, tmp_path):
    running = ModelLayout.from_folder(tiny_llama)
    assert running.tied_embeddings and "lm_head.weight" not in running.tensors
    assert running.tensors["model.layers.0.mlp.up_proj.weight"] == ((96, 64), "float32")
    sd = LocalEngine(tiny_llama).model.state_dict()  # holds the tied lm_head.weight: allowed, same shape
    check_layout(ModelLayout.from_state_dict(sd, running.architectures, True), running, "float32", "sd")
    bad = dict(sd, **{"model.layers.1.self_attn.q_proj.weight": torch.zeros(64, 32)})
    with pytest.raises(WeightMismatch, match=r"sd: tensor model.layers.1.self_attn.q_proj.weight has shape \[64, 32\]"):
        check_layout(ModelLayout.from_state_dict(bad, running.architectures, True), running, "float32", "sd")
    extra = dict(sd, **{"model.layers.2.mlp.up_proj.weight": torch.zeros(96, 64)})
    with pytest.raises(WeightMismatch, match="model.layers.2.mlp.up_proj.weight is not in the running model"):
        check_layout(ModelLayout.from_state_dict(extra, running.architectures, True), running, "float32", "sd")
    half = {k: v.half() for k, v in sd.items()}
    with pytest.raises(WeightMismatch, match="is float16, the server runs bfloat16"):
        check_layout(ModelLayout.from_state_dict(half, running.architectures, True), running, "bfloat16", "sd")
    # a server with dtype "auto" runs the dtype of the folder it loaded
    with pytest.raises(WeightMismatch, match="is float16, the server runs float32"):
        check_layout(ModelLayout.from_state_dict(half, running.architectures, True), running, "auto", "sd")


def test_probe_comparison():
    probe = LogprobProbe([1, 2, 3], [-1.0, -2.0], tolerance=1e-3)
    assert compare_probe(probe, [-1.0015, -2.0], "s") == pytest.approx(7.5e-4)  # the mean |difference|
    with pytest.raises(WeightMismatch, match=r"by 0.005 on average .*probe token 2, -2.010000 vs -2.000000"):
        compare_probe(probe, [-1.0, -2.01], "s")
    with pytest.raises(WeightMismatch, match="probe token 1"):
        compare_probe(probe, [float("nan"), -2.0], "s")
    with pytest.raises(WeightMismatch, match="1 log-probs for a probe of 2"):
        compare_probe(probe, [-1.0], "s")


def test_buckets_are_of_one_dtype_and_bounded_and_flatten_like_sglang():
    sd = {"a": torch.arange(6, dtype=torch.float32), "b": torch.ones(2, 3), "c": torch.ones(5, dtype=torch.bfloat16),
          "d": torch.zeros(3, dtype=torch.bfloat16), "e": torch.full((40,), 2.0)}
    assert buckets(sd, bucket_bytes=64) == [["a", "b"], ["c", "d"], ["e"]]  # a tensor over the limit goes alone
    flat = flatten([sd["a"], sd["b"]])
    assert flat.dtype == torch.uint8 and flat.numel() == 48
    # SGLang's receiver reads each tensor back at its byte offset (FlattenedTensorBucket.reconstruct_tensors)
    assert torch.equal(flat[:24].view(torch.float32), sd["a"]) and torch.equal(flat[24:].view(torch.float32).view(2, 3),
                                                                               sd["b"])


def test_launch_command_and_environment():
    cfg = SGLangConfig(server_python="/opt/sg/bin/python", dtype="bfloat16", tp_size=2, host="0.0.0.0",
                       extra_server_args=["--device", "cpu"], server_env={"SGLANG_USE_CPU_ENGINE": "1"})
    cmd = server_command(cfg, "/m", 30005, index=1, api_key="k")
    assert cmd[:3] == ["/opt/sg/bin/python", "-m", "sglang.launch_server"]
    flags = dict(zip(cmd[3::2], cmd[4::2]))
    assert flags["--dtype"] == "bfloat16" and flags["--base-gpu-id"] == "2" and flags["--port"] == "30005"
    assert flags["--host"] == "0.0.0.0" and cmd[-2:] == ["--device", "cpu"]
    torchrun = {"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "3", "MASTER_ADDR": "n0", "MASTER_PORT": "29500",
                "TORCHELASTIC_RUN_ID": "x", "LOCAL_WORLD_SIZE": "4", "GROUP_RANK": "0", "PATH": "/bin"}
    assert server_env(cfg, torchrun) == {"PATH": "/bin", "SGLANG_USE_CPU_ENGINE": "1"}
    with pytest.raises(ValueError, match="dtype once"):
        SGLangConfig(extra_server_args=["--dtype", "float16"])
    with pytest.raises(ValueError, match="must be one of disk, memory"):
        SGLangConfig(weight_sync="nccl")


def test_streamed_phase_writes_the_same_shards_and_keeps_them_after_a_failure(server, tiny_llama, tmp_path):
    from megamu.rollout.dataset import StageDataset
    from megamu.rollout.phase import run_rollout_phase
    from tests.rollout.test_phase import SAMPLING, ParityScorer, _assert_same_groups, make_prompts
    from tests.tiny import build_char_tokenizer

    tok = build_char_tokenizer()
    prompts = make_prompts(tok)
    kw = dict(sampling=SAMPLING, n_samples=3, scorer=ParityScorer(), tokenizer=tok, stage=1, groups_per_shard=2)
    client = _client(server, server_concurrency=6)

    class CallByCall(EngineBase):  # the same server through generate() only: the call-by-call path
        name = "sglang"
        generate = client.generate

    run_rollout_phase(CallByCall(), prompts, tmp_path / "calls", shards_per_call=2, **kw)
    server.faults = ["sleep:0"] * 4 + ["400"]  # the fifth request (of 7) is refused: the phase stops there
    with pytest.raises(SGLangError, match="HTTP 400"):
        run_rollout_phase(client, prompts, tmp_path / "streamed", max_in_flight=2, **kw)
    kept = sorted(p.name for p in (tmp_path / "streamed").glob("shard-*"))
    assert kept and len(kept) < 4  # the shards finished before the failure stay on disk
    m = run_rollout_phase(client, prompts, tmp_path / "streamed", max_in_flight=3, **kw)  # resumed
    assert m.engine == "sglang" and m.num_groups == 7
    _assert_same_groups(StageDataset(tmp_path / "streamed").groups(), StageDataset(tmp_path / "calls").groups())


def test_push_transport_follows_placement():
    """Servers on the trainer's GPUs get IPC tensors; disjoint ones a broadcast group; no configuration puts two ranks
    of one NCCL communicator on one device (NCCL: "Duplicate GPU detected"). gloo (CPU) accepts a shared device."""
    from megamu.engines.sglang.tensor_sync import transport

    table = {(shared, backend): transport(shared, backend) for shared in (True, False) for backend in ("nccl", "gloo")}
    assert table == {(True, "nccl"): "tensor", (False, "nccl"): "distributed", (True, "gloo"): "distributed",
                     (False, "gloo"): "distributed"}
    assert not [k for k, v in table.items() if v == "distributed" and k == (True, "nccl")]


def test_placement_follows_the_rollout_mode(tmp_path):
    from megamu.arguments import parse_args
    from megamu.runtime.device import Device

    base = ["--save", str(tmp_path / "run"), "--rollout-engine", "sglang"]
    colocated = parse_args(base + ["--rollout-mode", "colocated"], device=Device("cuda")).engine.sglang
    staged = parse_args(base, device=Device("cuda")).engine.sglang
    asyn = parse_args(base + ["--rollout-mode", "async", "--train-iters", "8", "--rollout-devices", "2,3"],
                      device=Device("cuda")).engine.sglang
    assert (colocated.shares_trainer_devices, colocated.weight_sync, colocated.memory_saver) == (True, "memory", True)
    assert not asyn.shares_trainer_devices and not staged.memory_saver
    assert colocated.sync_master_address == "127.0.0.1"  # no MASTER_ADDR outside torchrun


def test_a_tensor_bucket_round_trips_through_its_serialization():
    """The payload a server rank reads: with torch.multiprocessing's own loader (what SGLang's restricted unpickler
    allows), the flat tensor and its metadata give back every tensor bitwise (CPU: shared-memory files)."""
    import base64
    import pickle

    import torch

    from megamu.engines.sglang.tensor_sync import serialize_bucket

    named = [("a.weight", torch.randn(3, 5)), ("b.bias", torch.arange(7, dtype=torch.float32)),
             ("c", torch.randn(2, 2).to(torch.bfloat16))]
    payload, keep = serialize_bucket(named)
    obj = pickle.loads(base64.b64decode(payload))
    flat, meta = obj["flattened_tensor"], obj["metadata"]
    assert flat.dtype == torch.uint8 and flat.numel() == sum(t.numel() * t.element_size() for _, t in named)
    for (name, t), m in zip(named, meta):
        back = flat[m.start_idx:m.end_idx].view(m.dtype).view(m.shape)
        assert (m.name, m.numel) == (name, t.numel() * t.element_size()) and torch.equal(back, t)
    del keep
