import importlib.util
import subprocess
import sys
import time

import pytest
import torch
from transformers import AutoModelForCausalLM

from megamu.rollout import make_engine
from megamu.rollout.local import LocalEngine
from megamu.rollout.sglang import SGLangEngine, SGLangError, _stop_processes
from megamu.rollout.types import GenerateRequest, SamplingParams
from tests.processes import pid_alive
from tests.rollout.schema_server import SchemaServer


@pytest.fixture
def server(tiny_llama):
    srv = SchemaServer(LocalEngine(tiny_llama))
    yield srv
    srv.close()


def _client(server, **kw):
    kw = dict(dict(api_key="secret", backoff_s=0.05, max_retries=3, max_concurrency=4), **kw)
    return make_engine("sglang", None, urls=[server.url], **kw)


def _requests(seed):
    sp = SamplingParams(temperature=0.8, max_new_tokens=10, n=3, seed=seed)
    return [GenerateRequest(40 + i, [5 + i, 9, 14, 20 + i], sp) for i in range(4)]


@pytest.mark.parametrize("seed", [7, None])
def test_groups_and_logprob_mapping(server, tiny_llama, seed):
    client = _client(server)
    reqs = _requests(seed)
    out = client.generate(reqs)
    assert [(s.prompt_id, s.sample_index) for s in out] == [(r.prompt_id, j) for r in reqs for j in range(3)]
    # The mapping: each sample carries exactly the ids/log-probs/finish reason the server answered for its prompt.
    answered = {}
    for entry in server.log:
        ids = entry["body"]["input_ids"]
        results = entry["response"] if isinstance(entry["response"], list) else [entry["response"]]
        answered[tuple(ids[0] if isinstance(ids[0], list) else ids)] = results
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    for r in reqs:
        group = [s for s in out if s.prompt_id == r.prompt_id]
        for s, res in zip(group, answered[tuple(r.prompt_ids)]):
            assert s.output_ids == res["output_ids"]
            assert s.output_logprobs == [p[0] for p in res["meta_info"]["output_token_logprobs"]]
            assert s.finish_reason == res["meta_info"]["finish_reason"]["type"]
        # and they are log_softmax(logits / T) of the model (teacher forcing), i.e. what SGLang returns
        s = group[-1]
        with torch.no_grad():
            logits = model(torch.tensor([r.prompt_ids + s.output_ids])).logits[0, len(r.prompt_ids) - 1 : -1]
        expected = torch.log_softmax(logits / 0.8, -1).gather(1, torch.tensor(s.output_ids)[:, None]).squeeze(1)
        torch.testing.assert_close(torch.tensor(s.output_logprobs), expected, atol=1e-5, rtol=0)
        assert len({tuple(x.output_ids) for x in group}) == 3
    if seed is not None:  # seeded groups are sent as a batch, one sampling_seed per sample, and are reproducible
        assert all(isinstance(e["body"]["sampling_params"], list) for e in server.log)
        seeds = [p["sampling_seed"] for e in server.log for p in e["body"]["sampling_params"]]
        assert len(set(seeds)) == len(seeds) == 12
        again = _client(server).generate(reqs)
        assert [s.output_ids for s in again] == [s.output_ids for s in out]
    else:
        assert all(e["body"]["sampling_params"]["n"] == 3 for e in server.log)
    client.shutdown()


def test_retries_after_503_and_dropped_connection(server):
    client = _client(server)
    server.faults = ["503", "drop", "503"]
    out = client.generate(_requests(1)[:1])
    assert len(out) == 3 and not server.faults
    assert len(server.log) == 1  # three failed attempts, then one answer
    server.faults = ["503"] * 10
    with pytest.raises(SGLangError, match="failed after 4 attempts.*503"):
        client.generate(_requests(1)[:1])


def test_timeout_is_an_error(server):
    client = _client(server, request_timeout_s=0.5)
    server.faults = ["sleep:2"]
    t0 = time.monotonic()
    with pytest.raises(SGLangError, match="within 0.5s"):
        client.generate(_requests(1)[:1])
    assert time.monotonic() - t0 < 2


def test_wrong_api_key_and_update_weights(server, tiny_llama, tmp_path):
    with pytest.raises(SGLangError, match="not healthy"):
        _client(server, api_key="wrong", startup_timeout_s=0.5)
    from megamu.tiny import save_tiny_model

    other = save_tiny_model(tmp_path / "other", "llama", seed=5)
    client = _client(server)
    client.update_weights(str(other))
    s = client.generate([GenerateRequest(0, [5, 6, 7], SamplingParams(max_new_tokens=6, seed=0))])[0]
    model = AutoModelForCausalLM.from_pretrained(other, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([[5, 6, 7] + s.output_ids])).logits[0, 2:-1]
    expected = torch.log_softmax(logits, -1).gather(1, torch.tensor(s.output_ids)[:, None]).squeeze(1)
    torch.testing.assert_close(torch.tensor(s.output_logprobs), expected, atol=1e-5, rtol=0)


def test_launch_failure_shows_log_tail(tmp_path):
    # A bogus server flag makes the launched process exit at once, with or without sglang installed.
    with pytest.raises(SGLangError, match="exited with code") as e:
        SGLangEngine(str(tmp_path), port_base=39111, startup_timeout_s=60, log_dir=str(tmp_path / "logs"),
                     extra_server_args=["--no-such-flag-megamu"])
    assert "server_0.log" in str(e.value)


@pytest.mark.skipif(importlib.util.find_spec("sglang") is None or not torch.cuda.is_available(),
                    reason="needs sglang and a GPU")
def test_real_sglang_server_logprobs(tiny_llama):
    engine = SGLangEngine(tiny_llama, port_base=39200, startup_timeout_s=600)
    try:
        reqs = _requests(3)
        out = engine.generate(reqs)
        model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
        for s in out:
            prompt = next(r.prompt_ids for r in reqs if r.prompt_id == s.prompt_id)
            with torch.no_grad():
                logits = model(torch.tensor([prompt + s.output_ids])).logits[0, len(prompt) - 1 : -1]
            expected = torch.log_softmax(logits / 0.8, -1).gather(1, torch.tensor(s.output_ids)[:, None]).squeeze(1)
            torch.testing.assert_close(torch.tensor(s.output_logprobs), expected, atol=1e-3, rtol=0)
    finally:
        pids = engine.pids
        engine.shutdown()
    assert pids and not any(pid_alive(p) for p in pids)


STUBBORN_SERVER = """
import os, signal, subprocess, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
ignore = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"
child = subprocess.Popen([sys.executable, "-c", ignore])
print(child.pid, flush=True)
time.sleep(600)
"""


def test_shutdown_kills_the_server_process_group():
    # A "server" that ignores SIGTERM and has a child that does too: both must be gone after the grace period.
    proc = subprocess.Popen([sys.executable, "-c", STUBBORN_SERVER], stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    child = int(proc.stdout.readline())
    t0 = time.monotonic()
    _stop_processes([proc], grace_s=0.5)
    assert time.monotonic() - t0 < 5
    deadline = time.monotonic() + 5
    while pid_alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not pid_alive(proc.pid) and not pid_alive(child)


def test_requests_move_to_a_healthy_server(server, tiny_llama):
    broken = SchemaServer(LocalEngine(tiny_llama))
    try:
        broken.faults = ["503"] * 100
        client = make_engine("sglang", None, urls=[broken.url, server.url], api_key="secret", backoff_s=0.01)
        out = client.generate(_requests(2))
        assert len(out) == 12 and len(server.log) == 4 and not broken.log
    finally:
        broken.close()


def test_make_engine_kinds(tiny_llama):
    assert isinstance(make_engine("local", tiny_llama), LocalEngine)
    with pytest.raises(ValueError, match="unknown rollout engine 'vllm'"):
        make_engine("vllm", tiny_llama)
    with pytest.raises(ValueError, match="hf_dir .* or urls"):
        make_engine("sglang", None)
