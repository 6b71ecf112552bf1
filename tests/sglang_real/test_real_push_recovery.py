"""The real SGLang 0.5.23 server (CPU build) under the last resort of megamu's push recovery
(megamu/engines/sglang/push_recovery.py): a reload of an HF folder written from in-memory tensors
(push_recovery.write_recovery_export) serves exactly those weights; and a folder it cannot read ends the server
rather than rolling it back (its roll-back reloads the same folder: test_push_recovery_upstream.py), which is why
megamu checks its export whole before asking. References: transformers' teacher-forced log-probs of the same folders
(float32 on both sides, a 2-layer model: 1e-4, as test_real_server.py)."""

import shutil

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from megamu.engines.sglang.client import SGLangEngine, SGLangError
from megamu.engines.sglang.push_recovery import write_recovery_export
from tests.sglang_real.cpu_build import cpu_config
from tests.tiny import save_tiny_model
from tests.torchrun import server_ports

IDS = [1, 5, 9, 14, 3, 7, 11, 2]


def _reference(folder: str) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([IDS])).logits[0, :-1].double()
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(IDS[1:])[:, None]).squeeze(1)


def _served(engine: SGLangEngine) -> torch.Tensor:
    return torch.tensor(engine.teacher_forced_logprobs(IDS), dtype=torch.float64)


def test_an_export_of_pushed_tensors_reloads_them_and_an_unreadable_folder_ends_the_server(tmp_path):
    torch.set_num_threads(1)
    base = str(save_tiny_model(tmp_path / "launch" / "base", "llama", seed=0))
    other = str(save_tiny_model(tmp_path / "other", "llama", seed=5))
    broken = tmp_path / "broken"
    shutil.copytree(other, broken)
    (weights,) = broken.glob("*.safetensors")  # the header stays whole, the data cut
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    engine = SGLangEngine(base, cpu_config(server_ports(), tmp_path / "logs"))
    try:
        torch.testing.assert_close(_served(engine), _reference(base), atol=1e-4, rtol=0)
        tensors = {}
        for f in sorted((tmp_path / "other").glob("*.safetensors")):
            tensors.update(load_file(str(f)))
        export = write_recovery_export(tensors, tmp_path / "launch" / "base", stage=2)
        report = engine.update_weights(hf_dir=str(export), version=2)
        assert report.version == "2" and engine.weight_version == "2"
        torch.testing.assert_close(_served(engine), _reference(other), atol=1e-4, rtol=0)
        with pytest.raises(SGLangError):  # SGLang 0.5.23: the load fails twice and the server exits
            engine.update_weights(hf_dir=str(broken), version=3)
        with pytest.raises(SGLangError):
            _served(engine)  # nothing answers any more: no half-loaded weights are served
    finally:
        engine.shutdown()
