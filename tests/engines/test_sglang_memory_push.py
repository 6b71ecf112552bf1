"""In-memory weight pushes into servers megamu launched, and what a server restarted after one gets back.

Both transports of megamu/engines/sglang/tensor_sync.py run here against the schema server in its own process
(tests/engines/fake_sglang), which receives them as SGLang's TP rank 0 does: "distributed" joins the trainer's gloo
broadcast group; "tensor" (the transport of servers on the trainer's GPUs: placement shared, backend nccl) opens the
handles of CPU tensors in shared memory, as the real CPU server does in test-sglang's test_tensor_push_into_the_server.

The weights pushed are another model's (seed 5), so a server serving its launch folder draws other samples: a stage
whose dataset equals a fault-free run through servers of that other model shows the restarted server was given the
push again (from the host copy the engine keeps) before it took requests."""

import os
import signal
import time

import pytest
import torch

from megamu.engines.local import LocalEngine
from megamu.engines.sglang.client import SGLangEngine
from tests.engines.schema_server import SchemaServer
from tests.engines.test_sglang_health import _assert_same_samples, _config, _key, _on_first_shard, _phase
from tests.tiny import save_tiny_model

TRANSPORTS = {"distributed": {}, "tensor": dict(shares_trainer_devices=True, sync_backend="nccl")}


@pytest.fixture(scope="module")
def other(tmp_path_factory):
    return str(save_tiny_model(tmp_path_factory.mktemp("other"), "llama", seed=5))


@pytest.fixture(scope="module")
def reference_other(other, tmp_path_factory):
    """The fault-free dataset of the other model, through an in-process schema server."""
    out = tmp_path_factory.mktemp("reference_other") / "stage"
    server = SchemaServer(LocalEngine(other))
    engine = SGLangEngine(None, urls=[server.url], api_key="secret")
    try:
        _phase(engine, out)
    finally:
        engine.shutdown()
        server.close()
    return _key(out)


def _state_dict(model_dir: str) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in LocalEngine(model_dir).model.state_dict().items()}


@pytest.mark.parametrize("transport", sorted(TRANSPORTS))
def test_a_server_restarted_after_an_in_memory_push_gets_the_push_again(tiny_llama, other, reference_other,
                                                                       tmp_path, transport):
    from megamu.engines.sglang.tensor_sync import transport as chosen

    cfg = _config(tmp_path, 1, **TRANSPORTS[transport])
    assert chosen(cfg.shares_trainer_devices, cfg.sync_backend) == transport
    engine = SGLangEngine(tiny_llama, cfg)
    out, pid = tmp_path / "stage", engine.pids[0]
    try:
        pushed = _state_dict(other)
        report = engine.update_weights(state_dict=pushed, version=3)
        assert report.mode.startswith("memory") and report.bytes == sum(t.numel() * t.element_size()
                                                                       for t in pushed.values())
        assert engine.sync.restore_tensors is not None and all(  # a copy, not the caller's tensors
            torch.equal(engine.sync.restore_tensors[n], t) and engine.sync.restore_tensors[n].data_ptr() != t.data_ptr()
            for n, t in pushed.items())
        _on_first_shard(out, lambda: os.kill(pid, signal.SIGKILL))
        manifest = _phase(engine, out)
        events = [e["event"] for e in engine.health_events]
        new_pid = engine.pids[0]
    finally:
        engine.shutdown()
    assert events == ["dead", "restarted"] and new_pid != pid and manifest.extra["servers"][0]["restarts"] == 1
    _assert_same_samples(_key(out), reference_other)  # all of the pushed model's samples, none of the launch folder's


def test_no_host_copy_without_restarts(tiny_llama, other, tmp_path):
    """--rollout-max-restarts 0: nothing is restarted, so no copy of the pushed weights is kept in host memory."""
    engine = SGLangEngine(tiny_llama, _config(tmp_path, 1, max_restarts=0))
    try:
        engine.update_weights(state_dict=_state_dict(other), version=2)
        assert engine.sync.restore_tensors is None and engine.weight_version == "2"
    finally:
        engine.shutdown()


def test_a_given_server_declared_dead_is_told_to_abort(tiny_llama, tmp_path):
    """A server megamu did not start and cannot restart, which stops answering its probes (maybe only slow): its
    requests move to the live server, and it is asked to abort what it still runs (/abort_request)."""
    from megamu.engines.sglang.client import SGLangConfig
    from megamu.engines.types import GenerateRequest, SamplingParams
    from tests.engines.test_sglang_health import HEALTH

    servers = [SchemaServer(LocalEngine(tiny_llama)) for _ in range(2)]
    servers[1].delay_s = 0.2
    engine = SGLangEngine(None, SGLangConfig(urls=[s.url for s in servers], api_key="secret", **HEALTH))
    try:
        slow = servers[0]
        slow.faults = ["sleep:6"] * 50  # holds its requests; its probes time out meanwhile
        handler = slow.httpd.RequestHandlerClass
        probe = handler.do_GET
        handler.do_GET = lambda self: time.sleep(2) if self.path.startswith("/health") else probe(self)
        reqs = [GenerateRequest(i, [5, 6, 7 + i], SamplingParams(max_new_tokens=3, n=2, seed=1)) for i in range(6)]
        assert len(engine.generate(reqs)) == 12
        deadline = time.time() + 10
        while "/abort_request" not in slow.calls and time.time() < deadline:
            time.sleep(0.05)
        events = [e["event"] for e in engine.health_events]
    finally:
        engine.shutdown()
        for s in servers:
            s.close()
    assert events[:1] == ["dead"] and "aborted" in events and "/abort_request" in slow.calls


def test_the_sync_group_forms_under_torchrun(monkeypatch):
    """The trainer runs under torchrun, whose TORCHELASTIC_USE_AGENT_STORE makes torch.distributed.rendezvous connect
    to the given port as a client instead of serving a store there: made that way, rank 0 and the servers all waited
    for a store nobody served (found by the two-node in-memory test). Rank 0 here under those variables, the server's
    side in a process without them, as SGLang's is: the group forms and a broadcast arrives."""
    import subprocess
    import sys

    from megamu.engines.sglang.weight_sync import broadcast, open_weight_group
    from megamu.runtime.net import free_port
    from tests.engines.test_sglang_health import REPO

    port = free_port("127.0.0.1")
    child = subprocess.Popen([sys.executable, "-c", f"""
import sys; sys.path.insert(0, {str(REPO)!r})
import torch
from megamu.engines.sglang.weight_sync import broadcast, open_weight_group
pg = open_weight_group('127.0.0.1', {port}, 2, 'g', 'gloo', 30, rank=1)
t = torch.zeros(3); broadcast(pg, t); print(t.tolist(), flush=True)
import os; os._exit(0)  # a live gloo group's threads abort a normal interpreter exit now and then (SIGABRT, -6)
"""], stdout=subprocess.PIPE, text=True, env={k: v for k, v in os.environ.items() if not k.startswith("TORCHELASTIC")})
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    try:
        pg = open_weight_group("127.0.0.1", port, 2, "g", "gloo", 30)
        broadcast(pg, torch.tensor([1.0, 2.0, 3.0]))
        out = child.communicate(timeout=60)[0]
    finally:
        if child.poll() is None:
            child.kill()
    assert child.returncode == 0 and out.strip() == "[1.0, 2.0, 3.0]"
