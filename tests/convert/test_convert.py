"""megamu's own HF mapping (the trainer's initial load and every HF export) against transformers, at TP=1; TP=2 and
the torch_dist converter: test_mbridge.py."""

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from megamu.convert import export_hf, load_hf_into_model
from megamu.convert.io import SafetensorsDir
from megamu.model import ModelArch, build_model, forward_logprobs
from megamu.runtime.parallel import init_distributed
from tests.convert.conftest import CASES


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    reader = SafetensorsDir(folder)
    return {n: reader.get(n) for n in reader.keys()}


def _hf_logits(folder, ids):
    with torch.no_grad():
        return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)(ids).logits


@pytest.mark.parametrize("name", list(CASES))
def test_hf_load_tp1_matches_transformers_and_exports_bitwise(name, tiny_hf, tmp_path):
    hf_dir = tiny_hf[name]
    init_distributed(1)
    arch = ModelArch.from_hf(hf_dir)
    model = build_model(arch)
    load_hf_into_model(model, arch, hf_dir)
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
    out = export_hf(model, arch, tmp_path / "export", hf_source_dir=hf_dir, dtype="fp32", max_shard_bytes=40_000)
    want, got = _tensors(hf_dir), _tensors(out)
    assert set(got) == set(want) and all(got[n].dtype == want[n].dtype and torch.equal(got[n], want[n]) for n in want)
    assert len(set(json.loads((out / "model.safetensors.index.json").read_text())["weight_map"].values())) > 1
    for f in ("generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        assert json.loads((out / f).read_text()) == json.loads((hf_dir / f).read_text()), f
    config = json.loads((out / "config.json").read_text())
    assert config.pop("dtype") == "float32"
    assert config == {k: v for k, v in json.loads((hf_dir / "config.json").read_text()).items() if k != "dtype"}


def test_unsupported_config_names_the_field(tiny_hf):
    from tests.tiny import tiny_hf_config

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
    init_distributed(1)
    arch = ModelArch.from_hf(broken)
    with pytest.raises(KeyError, match=r"qwen3.*model\.layers\.1\.self_attn\.k_norm\.weight"):
        load_hf_into_model(build_model(arch), arch, broken)
