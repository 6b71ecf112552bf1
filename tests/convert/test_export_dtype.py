"""HF exports in the training precision: tensors, config.json and transformers' logits agree."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from megamu.convert import export_hf, load_hf_into_model
from megamu.convert.io import SafetensorsDir
from megamu.model import ModelArch, build_model

BF16_UNIT_ROUNDOFF = 2.0**-9  # round-to-nearest into bf16 (8 significand bits) errs by at most this, relatively


def _exported(folder):
    reader = SafetensorsDir(folder)
    return {n: reader.get(n) for n in reader.keys()}, json.loads((folder / "config.json").read_text())


@pytest.mark.parametrize("bf16", [True, False])
def test_export_follows_the_training_precision_and_says_so_in_config(distributed, tiny_hf, tmp_path, bf16):
    hf = tiny_hf["qwen2"]
    arch = ModelArch.from_hf(hf)
    model = build_model(arch, bf16=bf16)
    load_hf_into_model(model, arch, hf)
    tensors, config = _exported(export_hf(model, arch, tmp_path / "export", hf_source_dir=hf))
    want_dtype, want_name = (torch.bfloat16, "bfloat16") if bf16 else (torch.float32, "float32")
    assert {t.dtype for t in tensors.values()} == {want_dtype}
    assert config["dtype"] == want_name and config.get("torch_dtype", want_name) == want_name
    source, _ = _exported(hf)
    for n, t in source.items():  # loading rounded the fp32 source into bf16 once; the export adds no other change
        assert torch.equal(tensors[n], t.to(want_dtype)), n
    # --export-dtype overrides
    tensors, config = _exported(export_hf(model, arch, tmp_path / "fp32", hf_source_dir=hf, dtype="fp32"))
    assert {t.dtype for t in tensors.values()} == {torch.float32} and config["dtype"] == "float32"


def test_bf16_export_logits_in_transformers_match_the_trainer(distributed, tiny_hf, tmp_path):
    """The engine serves the export; the trainer computes with fp32 weights. Rounding each weight to bf16 moves it by
    at most u = 2^-9 relative, so a logit moves by at most ~u x (the sum over its path of |weight x activation|);
    transformers on the bf16 export, evaluated in fp32, must therefore agree with the fp32 trainer to a few u of the
    logit scale, and exactly with transformers on the same weights rounded in memory."""
    hf = tiny_hf["llama"]
    arch = ModelArch.from_hf(hf)
    model = build_model(arch)  # an fp32 trainer exporting bf16 for the engine (--export-dtype bf16)
    load_hf_into_model(model, arch, hf)
    out = export_hf(model, arch, tmp_path / "export", hf_source_dir=hf, dtype="bf16")
    ids = torch.randint(0, arch.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        served = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)(ids).logits
        rounded = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)
        for p in rounded.parameters():
            p.copy_(p.bfloat16().float())
        assert (served - rounded(ids).logits).abs().max() <= 1e-5  # fp32 reduction order only
        ours = model(ids, torch.arange(16).expand(2, 16), None)[..., : arch.vocab_size]
    scale = ours.abs().max()
    # The exact check is the one above; against the trainer, a logit passes ~10 rounded matrices (2 layers of
    # q/k/v/o/gate/up/down, embedding, head), each adding up to u x |W||x| (>= u x |Wx|, by the cancellation in the
    # sum): 64 u of the logit scale is a ceiling with room for that, and a small fraction of the O(scale) error of a
    # wrong export (a misplaced or mis-rounded tensor).
    assert (served - ours).abs().max() <= 64 * BF16_UNIT_ROUNDOFF * scale
