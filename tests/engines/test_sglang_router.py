"""--sglang-router against the real sglang-router (0.3.2, a test dependency; its Rust gateway runs on CPU), with
servers megamu launches (the schema server of tests/engines/fake_sglang): they join the router, every sample goes
through it and comes back as the servers drew it, a weight sync reaches the servers behind it, and they leave it.

What this router took, measured when the test was written: workers join by ``POST /workers`` (202, queued) and leave
by ``DELETE /workers/<id>``; ``/add_worker`` and ``/list_workers`` are 404; a ``/generate`` with a list of rids or of
sampling params is refused (422), so megamu sends it one sample per request, and ``sampling_seed`` passes through."""

import json
import subprocess
import sys
import time
import urllib.request

import pytest

from megamu.engines.local import LocalEngine
from megamu.engines.sglang.client import SGLangEngine
from megamu.engines.sglang.nodes import start_sglang
from megamu.engines.types import GenerateRequest, SamplingParams
from tests.engines.schema_server import SchemaServer
from tests.engines.test_sglang_health import _config
from tests.tiny import save_tiny_model
from tests.torchrun import free_port


@pytest.fixture
def router(tmp_path):
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port",
                             str(port), "--policy", "round_robin", "--log-level", "warn"],
                            stdout=open(tmp_path / "router.log", "w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            with urllib.request.urlopen(url + "/health", timeout=2):
                break
        except OSError as e:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                log = (tmp_path / "router.log").read_text()[-2000:]
                raise RuntimeError(f"the router did not start:\n{log}") from e
            time.sleep(0.2)
    yield url
    proc.terminate()
    proc.wait(timeout=30)


def _direct(model_dir: str, requests: list[GenerateRequest]) -> list[tuple]:
    server = SchemaServer(LocalEngine(model_dir))
    engine = SGLangEngine(None, urls=[server.url], api_key="secret")
    try:
        return [(s.prompt_id, s.sample_index, tuple(s.output_ids)) for s in engine.generate(requests)]
    finally:
        engine.shutdown()
        server.close()


def test_launched_servers_serve_through_the_real_router(tiny_llama, tmp_path, router):
    requests = [GenerateRequest(i, [5, 6, 7 + i], SamplingParams(max_new_tokens=4, n=2, seed=3)) for i in range(6)]
    other = str(save_tiny_model(tmp_path / "other", "llama", seed=5))
    dispatcher, node = start_sglang(tiny_llama, _config(tmp_path, 2, router=router, api_key="k"))
    try:
        listed = dispatcher.pool.call(router, "/workers", None, timeout=10)["workers"]
        assert sorted(w["url"] for w in listed) == sorted(node.urls) and dispatcher.routers == [router]
        assert dispatcher.control_urls == node.urls  # syncs and probes go to the servers themselves
        got = [(s.prompt_id, s.sample_index, tuple(s.output_ids)) for s in dispatcher.generate(requests)]
        assert got == _direct(tiny_llama, requests)  # each sample as its seed draws it, through the router
        stats = node.server_stats()
        assert all(s["requests"] == 0 for s in stats)  # the node's own engine sent nothing: the router did

        dispatcher.update_weights(hf_dir=other, version=2)  # to both servers behind the router; then checked on
        got = [(s.prompt_id, s.sample_index, tuple(s.output_ids)) for s in dispatcher.generate(requests)]  # samples
        assert got == _direct(other, requests)
    finally:
        dispatcher.shutdown()
        node.shutdown()
    with urllib.request.urlopen(router + "/workers", timeout=10) as f:
        assert json.loads(f.read())["workers"] == []  # both left before their servers stopped
