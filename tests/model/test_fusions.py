"""Megatron's fusions follow the layer spec: on with Transformer Engine, off on the local (CPU) spec."""

import importlib.util

import pytest

from megamu.model.config import FUSIONS, ModelArch, fusion_fields, transformer_config
from tests.tiny import tiny_hf_config


def test_te_config_has_megatrons_fusions_and_local_has_none(distributed, monkeypatch):
    arch = ModelArch.from_hf(tiny_hf_config("llama"))
    local = transformer_config(arch, tp=1, transformer_impl="local")
    assert not any(getattr(local, f) for f in FUSIONS)
    # TransformerConfig checks that TE's fused RoPE kernel exists; on a machine without TE, stand one in
    from megatron.core.models.common.embeddings import rope_utils

    monkeypatch.setattr(rope_utils, "fused_apply_rotary_pos_emb", lambda *a, **k: None, raising=False)
    te = transformer_config(arch, tp=1, transformer_impl="transformer_engine")
    on = ["bias_activation_fusion", "bias_dropout_fusion", "masked_softmax_fusion", "apply_rope_fusion"]
    assert all(getattr(te, f) is True for f in on)
    apex = importlib.util.find_spec("fused_weight_gradient_mlp_cuda") is not None
    assert te.gradient_accumulation_fusion is apex


def test_gradient_accumulation_fusion_needs_apex(monkeypatch):
    real = importlib.util.find_spec
    for present in (True, False):
        monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a, present=present: (
            object() if present else None) if name == "fused_weight_gradient_mlp_cuda" else real(name, *a))
        assert fusion_fields("transformer_engine")["gradient_accumulation_fusion"] is present
    with pytest.raises(ValueError, match="not supported"):
        fusion_fields("cuda")
