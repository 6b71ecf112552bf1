import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from megamu.engines import make_engine
from megamu.engines.local import LocalEngine
from megamu.engines.sglang.client import SGLangEngine, SGLangError, parse_sample
from megamu.engines.sglang.launch import group_alive, stop_processes
from megamu.engines.types import GenerateRequest, SamplingParams
from tests.engines.schema_server import SchemaServer
from tests.processes import pid_alive
from tests.torchrun import server_ports


def _client(server, **kw):
    kw = dict(dict(api_key="secret", backoff_s=0.05, max_retries=3, server_concurrency=12), **kw)
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
    # Seeded or not, a group goes as a batch with one sampling_seed per sample (never n copies sharing a seed),
    # each seed within int32.
    assert all(isinstance(e["body"]["sampling_params"], list) for e in server.log)
    seeds = [p["sampling_seed"] for e in server.log for p in e["body"]["sampling_params"]]
    assert len(set(seeds)) == len(seeds) == 12 and all(0 <= x < 2**31 for x in seeds)
    if seed is not None:  # and seeded groups are reproducible
        again = _client(server).generate(reqs)
        assert [s.output_ids for s in again] == [s.output_ids for s in out]
    assert client.deterministic is True
    client.shutdown()


def test_retries_after_503_and_dropped_connection(server):
    client = _client(server)
    server.faults = ["503", "drop", "503"]
    out = client.generate(_requests(1)[:1])
    assert len(out) == 3 and not server.faults
    assert len(server.log) == 1  # three failed attempts (each with fresh request ids), then one answer
    assert len(server.rids) == 4 * 3
    server.faults = ["503"] * 10
    with pytest.raises(SGLangError, match="failed after 4 attempts.*503"):
        client.generate(_requests(1)[:1])


def test_proxy_settings_are_ignored(server, monkeypatch):
    for var in ("http_proxy", "HTTP_PROXY"):  # a cluster's proxy for pip must not carry requests to our servers
        monkeypatch.setenv(var, "http://127.0.0.1:9")
    assert len(_client(server).generate(_requests(1)[:1])) == 3


def test_timeout_is_an_error(server):
    client = _client(server, request_timeout_s=0.5)
    server.faults = ["sleep:8"]
    t0 = time.monotonic()
    with pytest.raises(SGLangError, match="within 0.5s"):
        client.generate(_requests(1)[:1])
    assert time.monotonic() - t0 < 6  # the timeout's doing, not the answer's (8 s): margin for a loaded machine


def test_wrong_api_key_and_update_weights(server, tiny_llama, tmp_path):
    with pytest.raises(SGLangError, match="rejected the API key"):  # /health needs no key: /server_info tells
        _client(server, api_key="wrong", startup_timeout_s=0.5)
    from tests.tiny import save_tiny_model

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
        SGLangEngine(str(tmp_path), port_base=server_ports(), startup_timeout_s=60, log_dir=str(tmp_path / "logs"),
                     extra_server_args=["--no-such-flag-megamu"])
    assert "server_0.log" in str(e.value)


STUBBORN_SERVER = """
import os, signal, subprocess, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
ignore = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"
child = subprocess.Popen([sys.executable, "-c", ignore])
print(child.pid, flush=True)
time.sleep(600)
"""


LINGERING_CHILD = """
import signal, subprocess, sys, time
slow = ("import signal, sys, time, pathlib\\n"
        "def bye(*_):\\n    time.sleep(1.0); pathlib.Path(sys.argv[1]).write_text('released'); sys.exit(0)\\n"
        "signal.signal(signal.SIGTERM, bye)\\nprint('ready', flush=True)\\ntime.sleep(600)")
child = subprocess.Popen([sys.executable, "-c", slow, sys.argv[1]], stdout=subprocess.PIPE, text=True)
child.stdout.readline()  # its handler is installed
print(child.pid, flush=True)
time.sleep(600)  # the leader itself dies at once on SIGTERM, as SGLang's launcher does after signalling its children
"""


def test_shutdown_waits_for_children_that_outlive_the_leader(tmp_path):
    """SGLang's launcher exits without waiting for its scheduler: the stop must wait for the whole group, so the
    child's clean exit (which frees its device memory) happens before the stage reloads the trainer."""
    marker = tmp_path / "released"
    proc = subprocess.Popen([sys.executable, "-c", LINGERING_CHILD, str(marker)], stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    child = int(proc.stdout.readline())
    stop_processes([proc], grace_s=30)
    assert marker.read_text() == "released"  # not SIGKILLed as soon as the leader was gone
    assert not pid_alive(child) and not group_alive(proc.pid)


def test_shutdown_kills_the_server_process_group():
    # A "server" that ignores SIGTERM and has a child that does too: both must be gone after the grace period.
    proc = subprocess.Popen([sys.executable, "-c", STUBBORN_SERVER], stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    child = int(proc.stdout.readline())
    t0 = time.monotonic()
    stop_processes([proc], grace_s=0.5)
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


def test_parse_sample_one_logprob_per_token_and_finish_reasons():
    pairs = [[-0.5, 11, None], [-1.25, 7, "x"], [-0.125, 2, None]]
    result = {"text": "", "output_ids": [11, 7],  # output_ids trimmed of the stop token: not what we read
              "meta_info": {"finish_reason": {"type": "stop", "matched": 2}, "output_token_logprobs": pairs}}
    s = parse_sample(result, prompt_id=4, sample_index=1, stop_ids=[2])
    assert (s.prompt_id, s.sample_index, s.output_ids, s.output_logprobs, s.finish_reason) == \
        (4, 1, [11, 7, 2], [-0.5, -1.25, -0.125], "stop")
    # SGLang checks max_new_tokens before EOS: a complete reply ending in a stop token is still a "stop".
    length = {"meta_info": {"finish_reason": {"type": "length", "length": 3}, "output_token_logprobs": pairs}}
    assert parse_sample(length, 0, 0, stop_ids=[2]).finish_reason == "stop"
    assert parse_sample(length, 0, 0, stop_ids=[5]).finish_reason == "length"
    abort = {"meta_info": {"finish_reason": {"type": "abort", "message": "x"}, "output_token_logprobs": pairs[:1]}}
    assert parse_sample(abort, 0, 0).finish_reason == "abort"
    with pytest.raises(SGLangError, match="prompt 9 has no meta_info.output_token_logprobs"):
        parse_sample({"meta_info": {}}, 9, 0)


def test_server_checks_model_and_seed_support(server, tiny_llama, tmp_path):
    client = _client(server)
    assert client.deterministic is True and client.max_input_len is None  # the schema server reports no limit
    assert client.vocab_size == 101 and client.weight_version == "default"
    with pytest.raises(SGLangError, match="serves .* not .*another server holds the port"):
        client.check_server(server.url, str(tmp_path))
    server.deterministic = False
    assert _client(server).deterministic is False


def test_port_in_use_is_refused_before_launch(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(SGLangError, match=f"port {port} .* already in use"):
            SGLangEngine(str(tmp_path), port_base=port, log_dir=str(tmp_path / "logs"))
    assert not (tmp_path / "logs" / "server_0.log").exists()


ORPHAN_PARENT = """
import subprocess, sys, time
from megamu.engines.sglang.launch import _die_with_parent
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True,
                         preexec_fn=_die_with_parent)
print(child.pid, flush=True)
time.sleep(600)
"""


def test_server_dies_with_a_killed_trainer():
    # The launcher is SIGKILLed (no finalizer runs): its server, in its own session, must still go.
    parent = subprocess.Popen([sys.executable, "-c", ORPHAN_PARENT], stdout=subprocess.PIPE, text=True,
                              cwd=str(Path(__file__).resolve().parents[2]))
    child = int(parent.stdout.readline())
    try:
        assert pid_alive(child)
        parent.kill()
        parent.wait()
        deadline = time.monotonic() + 10
        while pid_alive(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not pid_alive(child)
    finally:
        parent.kill()
        if pid_alive(child):
            os.kill(child, signal.SIGKILL)
