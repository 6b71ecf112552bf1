"""Recompute granularity maps onto megatron-core's TransformerConfig (the gradients it gives: tests/gpu, since
megatron's activation checkpointing saves and restores the CUDA RNG state and so needs a GPU)."""

import pytest

from megamu.model.config import ModelArch, transformer_config
from tests.tiny import tiny_hf_config


def test_recompute_granularity_sets_megatrons_fields(distributed):
    arch = ModelArch.from_hf(tiny_hf_config("llama"))
    plain = transformer_config(arch, tp=1)
    assert plain.recompute_granularity is None
    full = transformer_config(arch, tp=1, recompute_granularity="full")
    assert (full.recompute_granularity, full.recompute_method, full.recompute_num_layers) == ("full", "uniform", 1)
    selective = transformer_config(arch, tp=1, recompute_granularity="selective")
    assert selective.recompute_granularity == "selective" and "core_attn" in selective.recompute_modules
    with pytest.raises(ValueError, match="recompute_granularity: 'block'"):
        transformer_config(arch, tp=1, recompute_granularity="block")
