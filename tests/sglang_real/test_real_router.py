"""--sglang-router with both real parts: sglang-router 0.3.2 and the real SGLang 0.5.23 CPU server megamu launches.
The server joins the router, samples go through it one per request, their log-probs are transformers' teacher-forced
ones, a sync from a folder reaches the server behind the router (the router has no weight-update route), and the
server leaves the router before it stops."""

import json
import urllib.request

import torch
from transformers import AutoModelForCausalLM

from megamu.engines.sglang.nodes import start_sglang
from megamu.engines.types import GenerateRequest, SamplingParams
from tests.engines.test_sglang_router import router  # noqa: F401  (fixture)
from tests.sglang_real.cpu_build import cpu_config
from tests.tiny import save_tiny_model
from tests.torchrun import server_ports

ATOL = 1e-4


def _check_logprobs(samples, prompts: dict, model_dir: str) -> None:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    for s in samples:
        prompt = prompts[s.prompt_id]
        with torch.no_grad():
            logits = model(torch.tensor([prompt + s.output_ids])).logits[0, len(prompt) - 1 : -1].double()
        expected = torch.log_softmax(logits, -1).gather(1, torch.tensor(s.output_ids)[:, None]).squeeze(1)
        torch.testing.assert_close(torch.tensor(s.output_logprobs, dtype=torch.float64), expected, atol=ATOL, rtol=0)


def test_real_server_behind_the_real_router(tmp_path, router):  # noqa: F811
    torch.set_num_threads(1)
    base = str(save_tiny_model(tmp_path / "base", "llama", seed=0))
    other = str(save_tiny_model(tmp_path / "other", "llama", seed=5))
    prompts = {i: [5 + i, 9, 14] for i in range(4)}
    requests = [GenerateRequest(i, p, SamplingParams(max_new_tokens=8, n=2, seed=1)) for i, p in prompts.items()]
    dispatcher, node = start_sglang(base, cpu_config(server_ports(), tmp_path / "logs", router=router))
    try:
        assert dispatcher.routers == [router] and dispatcher.control_urls == node.urls
        out = dispatcher.generate(requests)
        assert sorted((s.prompt_id, s.sample_index) for s in out) == [(i, j) for i in prompts for j in range(2)]
        _check_logprobs(out, prompts, base)
        report = dispatcher.update_weights(hf_dir=other, version=2)
        assert report.version == "2"
        out = dispatcher.generate(requests)  # the client refuses samples of another weight version
        _check_logprobs(out, prompts, other)
    finally:
        dispatcher.shutdown()
        node.shutdown()
    with urllib.request.urlopen(router + "/workers", timeout=10) as f:
        assert json.loads(f.read())["workers"] == []
