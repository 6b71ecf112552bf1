"""HF <-> megatron through mbridge, at TP=2 under torchrun: HF -> torch_dist (written at TP=1 in this process)
-> TP=2 model (bitwise as megamu's own mapping, transformers' logits and log-probs) -> HF, bitwise, both through
torch_dist_to_hf and the trainer's export_hf (see workers/tp2_mbridge.py); tools/convert_checkpoint.py."""

import json
from pathlib import Path

import pytest
import torch

from megamu.convert.bridge import supported_families
from megamu.convert.io import SafetensorsDir
from megamu.runtime.parallel import init_distributed
from megamu.training.torch_dist import hf_to_torch_dist
from tests.convert.conftest import CASES
from tests.torchrun import run_torchrun

WORKER = Path(__file__).parent / "workers" / "tp2_mbridge.py"


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    reader = SafetensorsDir(folder)
    return {n: reader.get(n) for n in reader.keys()}


def test_mbridge_serves_every_dense_family_megamu_supports():
    from megamu.model.config import FAMILIES

    assert set(FAMILIES) <= set(supported_families())


@pytest.mark.slow
def test_hf_to_torch_dist_to_tp2_to_hf_is_bitwise(tiny_hf, tmp_path):
    init_distributed(1)
    args = []
    for name in CASES:
        dist_dir = hf_to_torch_dist(tiny_hf[name], tmp_path / name / "torch_dist").parent
        assert (dist_dir / "latest_checkpointed_iteration.txt").read_text().strip() == "0"
        args += [tiny_hf[name], dist_dir, tmp_path / name / "export", tmp_path / name / "live"]
    (tmp_path / "llama" / "live").mkdir(parents=True)  # a stale export is replaced only by a complete one
    (tmp_path / "llama" / "live" / "stale.txt").write_text("old")
    proc = run_torchrun(WORKER, 2, *args, timeout=900)
    for name in CASES:
        assert f"OK {CASES[name][0]}" in proc.stdout
        want = _tensors(tiny_hf[name])
        for out in ("export", "live"):
            got = _tensors(tmp_path / name / out)
            assert set(got) == set(want), (name, out)
            for n in want:
                assert torch.equal(got[n], want[n]), (name, out, n)
        export = tmp_path / name / "export"
        assert len(set(json.loads((export / "model.safetensors.index.json").read_text())["weight_map"].values())) > 1
        for f in ("generation_config.json", "tokenizer.json", "tokenizer_config.json"):
            assert json.loads((export / f).read_text()) == json.loads((tiny_hf[name] / f).read_text()), (name, f)
        assert sorted(p.name for p in (tmp_path / name).iterdir()) == ["export", "live", "torch_dist"]  # no temps
    assert not (tmp_path / "llama" / "live" / "stale.txt").exists()


@pytest.mark.slow
def test_the_tool_converts_hf_to_torch_dist_and_back(tiny_hf, tmp_path):
    import subprocess
    import sys

    tool = Path(__file__).parents[2] / "tools" / "convert_checkpoint.py"
    hf_dir = tiny_hf["qwen3"]
    run = lambda *a: subprocess.run([sys.executable, str(tool), *map(str, a)], capture_output=True, text=True,
                                    timeout=600)
    r = run("hf-to-torch-dist", "--load", hf_dir, "--save", tmp_path / "ckpt")
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "ckpt" / "iter_0000000" / "metadata.json").exists()
    r = run("torch-dist-to-hf", "--load", tmp_path / "ckpt", "--hf-source", hf_dir, "--save", tmp_path / "hf",
            "--dtype", "fp32")
    assert r.returncode == 0, r.stderr
    want, got = _tensors(hf_dir), _tensors(tmp_path / "hf")
    assert set(got) == set(want) and all(torch.equal(got[n], want[n]) for n in want)
    r = run("torch-dist-to-hf", "--load", tmp_path / "ckpt", "--hf-source", hf_dir, "--save", tmp_path / "bf16")
    assert r.returncode == 0, r.stderr  # bf16 by default
    got = _tensors(tmp_path / "bf16")
    assert all(got[n].dtype == torch.bfloat16 and torch.equal(got[n], want[n].bfloat16()) for n in want)
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["dtype"] == "bfloat16"
    r = run("torch-dist-to-hf", "--load", tmp_path / "nothing", "--hf-source", hf_dir, "--save", tmp_path / "x")
    assert r.returncode == 2 and "--load" in r.stderr and "no such folder" in r.stderr
