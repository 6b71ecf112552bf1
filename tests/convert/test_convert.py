import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from megamu.convert import export_hf, hf_to_mcore, load_mcore_into_model, mcore_to_hf, read_arch
from megamu.convert.io import SafetensorsDir
from megamu.model import ModelArch, build_model, forward_logprobs
from megamu.parallel import init_distributed
from tests.convert.conftest import CASES
from tests.torchrun import run_torchrun

WORKER = Path(__file__).parent / "workers" / "tp2_convert.py"


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    reader = SafetensorsDir(folder)
    return {n: reader.get(n) for n in reader.keys()}


def _hf_logits(folder, ids):
    with torch.no_grad():
        return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)(ids).logits


@pytest.mark.parametrize("name", list(CASES))
def test_hf_to_mcore_tp1_matches_transformers(name, tiny_hf, tmp_path):
    hf_dir = tiny_hf[name]
    mcore = hf_to_mcore(hf_dir, tmp_path / "mcore", tp=2)
    init_distributed(1)
    arch = read_arch(mcore)
    model = build_model(arch)
    load_mcore_into_model(model, arch, mcore)
    ids = torch.randint(0, arch.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    ref = _hf_logits(hf_dir, ids)
    with torch.no_grad():
        logits = model(ids, torch.arange(24).expand(2, 24), None)
        assert (logits[..., : arch.vocab_size] - ref).abs().max() <= 1e-4
        for t in (1.0, 0.7):
            logp, ent = forward_logprobs(model, ids, temperature=t, with_entropy=True)
            ref_logp = torch.log_softmax(ref[:, :-1] / t, dim=-1)
            want = ref_logp.gather(-1, ids[:, 1:, None]).squeeze(-1)
            assert (logp - want).abs().max() <= 1e-4
            assert (ent - -(ref_logp.exp() * ref_logp).sum(-1)).abs().max() <= 1e-4
    out = export_hf(model, arch, tmp_path / "export", hf_source_dir=hf_dir, dtype="fp32")
    want, got = _tensors(hf_dir), _tensors(out)
    assert set(got) == set(want) and all(torch.equal(got[n], want[n]) for n in want)


def test_tp2_logits_and_live_export(tiny_hf, tmp_path):
    args = []
    for name, hf_dir in tiny_hf.items():
        args += [hf_dir, hf_to_mcore(hf_dir, tmp_path / name / "mcore", tp=2), tmp_path / name / "export"]
    (tmp_path / "llama" / "export").mkdir(parents=True)  # a stale export is replaced only by a complete one
    (tmp_path / "llama" / "export" / "stale.txt").write_text("old")
    proc = run_torchrun(WORKER, 2, *args, timeout=300)
    assert proc.stdout.count("OK ") == 2 * len(tiny_hf)
    ids = torch.randint(0, 300, (2, 20), generator=torch.Generator().manual_seed(2))
    for name, hf_dir in tiny_hf.items():
        export = tmp_path / name / "export"
        assert not (export / "stale.txt").exists()
        assert sorted(p.name for p in export.parent.iterdir()) == ["export", "mcore"]  # no temp folders left
        assert torch.equal(_hf_logits(export, ids), _hf_logits(hf_dir, ids))
        want = _tensors(hf_dir)
        got = _tensors(export)
        assert set(got) == set(want)
        assert "lm_head.weight" not in got or not read_arch(tmp_path / name / "mcore").tie_embeddings


def test_round_trip_is_bitwise(tiny_hf, tmp_path):
    for name in ("qwen2", "qwen3", "llama"):
        hf_dir = tiny_hf[name]
        mcore = hf_to_mcore(hf_dir, tmp_path / name / "mcore", tp=2, max_shard_bytes=40_000)
        index = json.loads((mcore / "model.safetensors.index.json").read_text())
        assert index["metadata"]["tensor_model_parallel_size"] == 2
        assert len(set(index["weight_map"].values())) > 1  # sharded
        out = mcore_to_hf(mcore, tmp_path / name / "hf", dtype="fp32", max_shard_bytes=40_000)
        want, got = _tensors(hf_dir), _tensors(out)
        assert set(got) == set(want), name
        for n in want:
            assert got[n].dtype == want[n].dtype and torch.equal(got[n], want[n]), f"{name} {n}"
        for f in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
            assert json.loads((out / f).read_text()) == json.loads((hf_dir / f).read_text()), f
        with safe_open(out / index_first_file(out), framework="pt") as h:
            assert h.metadata()["format"] == "pt"


def index_first_file(folder: Path) -> str:
    return sorted(set(json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"].values()))[0]


def test_bf16_export_and_cli(tiny_hf, tmp_path):
    import subprocess
    import sys

    tool = Path(__file__).parents[2] / "tools" / "convert_checkpoint.py"
    hf_dir = tiny_hf["qwen2"]
    run = lambda *a: subprocess.run([sys.executable, str(tool), *map(str, a)], capture_output=True, text=True)
    r = run("hf-to-mcore", "--load", hf_dir, "--save", tmp_path / "m", "--tensor-model-parallel-size", "2")
    assert r.returncode == 0, r.stderr
    r = run("mcore-to-hf", "--load", tmp_path / "m", "--save", tmp_path / "h")
    assert r.returncode == 0, r.stderr
    got, want = _tensors(tmp_path / "h"), _tensors(hf_dir)
    assert all(got[n].dtype == torch.bfloat16 and torch.equal(got[n], want[n].bfloat16()) for n in want)
    assert json.loads((tmp_path / "h" / "config.json").read_text())["dtype"] == "bfloat16"
    r = run("hf-to-mcore", "--load", hf_dir, "--save", tmp_path / "m3", "--tensor-model-parallel-size", "3")
    assert r.returncode == 1 and "num_heads=4 is not divisible by TP=3" in r.stderr


def test_unsupported_config_names_the_field(tiny_hf):
    from megamu.tiny import tiny_hf_config

    with pytest.raises(ValueError, match="hidden_act"):
        ModelArch.from_hf(tiny_hf_config("llama", hidden_act="gelu"))
    with pytest.raises(ValueError, match="rope_type"):
        ModelArch.from_hf(tiny_hf_config("llama", rope_scaling={"rope_type": "yarn", "factor": 2.0}))
    with pytest.raises(ValueError, match="model_type"):
        from transformers import MistralConfig

        ModelArch.from_hf(MistralConfig(hidden_size=64, num_attention_heads=4))
    with pytest.raises(ValueError, match="attention_bias"):
        ModelArch.from_hf(tiny_hf_config("llama", attention_bias=True))


def test_missing_tensor_names_tensor_and_family(tiny_hf, tmp_path):
    from safetensors.torch import save_file

    src = tiny_hf["qwen3"]
    broken = tmp_path / "broken"
    broken.mkdir()
    tensors = _tensors(src)
    del tensors["model.layers.1.self_attn.k_norm.weight"]
    save_file(tensors, str(broken / "model.safetensors"), metadata={"format": "pt"})
    (broken / "config.json").write_text((src / "config.json").read_text())
    with pytest.raises(KeyError, match=r"qwen3.*model\.layers\.1\.self_attn\.k_norm\.weight"):
        hf_to_mcore(broken, tmp_path / "out")
    assert not (tmp_path / "out").exists()  # nothing half-written

    mcore = hf_to_mcore(src, tmp_path / "mcore")
    mtensors = _tensors(mcore)
    del mtensors["decoder.layers.0.mlp.linear_fc1.weight"]
    save_file(mtensors, str(broken / "model.safetensors"), metadata={"format": "pt"})
    init_distributed(1)
    arch = read_arch(mcore)
    with pytest.raises(KeyError, match=r"qwen3.*decoder\.layers\.0\.mlp\.linear_fc1\.weight"):
        load_mcore_into_model(build_model(arch), arch, broken)
