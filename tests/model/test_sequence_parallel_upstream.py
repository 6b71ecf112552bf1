"""The megatron-core 0.16.1 facts megamu's ``--sequence-parallel`` relies on, pinned to the installed source: if a
newer megatron-core moves or drops one of these lines, this fails and the code that leans on it is to be revisited.

- ``transformer/torch_norm.py:32``: the local spec's norm (``WrappedTorchNorm``) asserts ``not
  config.sequence_parallel``: megamu's local spec builds its own ``megamu.model.spec.RMSNorm`` instead, for every
  norm, the decoder's final one included (``transformer/transformer_block.py:258``: given a layer spec alone, the block
  builds that norm from its module-level ``LayerNormImpl``, ``WrappedTorchNorm`` without TE or apex, ``:69``).
- ``fusions/fused_layer_norm.py:119`` and ``transformer/moe/router.py:74``: megatron's norms and routers mark their
  TP-replicated weights ``sequence_parallel``; ``distributed/finalize_model_grads.py:354`` sums over TP exactly the
  gradients so marked (and the q/k norms', by name) on the GPU path (megatron DDP, megamu.training.optimizer), the
  selection ``megamu.model.build.allreduce_tp_partial_grads`` makes on CPU.
- ``model_parallel_config.py:411``: SP at TP 1 raises; megamu refuses the flag there by name.
- ``tensor_parallel/mappings.py:141`` and ``:181`` (SP's gather before and reduce-scatter after each TP block) and
  ``tensor_parallel/layers.py:552`` (the linear layers' SP reduce-scatter in the backward) allocate on
  ``torch.cuda.current_device()``: CPU runs refuse the flag; the CPU test's workers answer it (tests/cpu_cuda_shim.py).
- ``models/gpt/gpt_model.py:668-675``: GPTModel's own last-token selection under SP gathers the sequence itself and
  turns the output layer's SP off for the call: what ``megamu.model.logprobs._output_layer_only_at`` does.
"""

import importlib
from pathlib import Path

import pytest


def _lines(module: str) -> list[str]:
    return Path(importlib.import_module(module).__file__).read_text().splitlines()


def _line(module: str, lineno: int) -> str:
    return _lines(module)[lineno - 1]


def test_the_local_specs_norm_refuses_sequence_parallelism_so_megamu_builds_its_own():
    assert "assert not config.sequence_parallel" in _line("megatron.core.transformer.torch_norm", 32)
    block = "megatron.core.transformer.transformer_block"
    assert "layer_specs=[spec] * num_layers, layer_norm=LayerNormImpl" in _line(block, 258)
    assert _line(block, 69).strip() == "LayerNormImpl = WrappedTorchNorm"


def test_megamus_local_model_builds_every_norm_as_its_own(distributed, tmp_path):
    """The local spec's norms, the final one included, are megamu's RMSNorm (none is WrappedTorchNorm's plain torch
    RMSNorm, which would refuse SP), each weight marked with the config's sequence_parallel (False here, TP 1)."""
    import torch

    from megamu.model import ModelArch, build_model
    from megamu.model.spec import RMSNorm
    from tests.tiny import save_tiny_model

    arch = ModelArch.from_hf(save_tiny_model(tmp_path / "qwen3", "qwen3", vocab_size=300))
    norms = [m for m in build_model(arch).modules() if isinstance(m, torch.nn.RMSNorm)]
    assert len(norms) == 4 * arch.num_layers + 1  # input, pre-MLP, q and k norms per layer; the final norm
    assert all(type(m) is RMSNorm and m.weight.sequence_parallel is False for m in norms)


@pytest.mark.parametrize("module, lineno", [("megatron.core.fusions.fused_layer_norm", 119),
                                            ("megatron.core.transformer.moe.router", 74)])
def test_megatron_marks_replicated_weights_sequence_parallel(module, lineno):
    line = _line(module, lineno)
    assert "setattr(self.weight, 'sequence_parallel'" in line and "sequence_parallel)" in line, line


def test_finalize_model_grads_sums_the_marked_gradients_over_tp():
    module = "megatron.core.distributed.finalize_model_grads"
    lines = _lines(module)
    assert 'elif (config.sequence_parallel and getattr(param, "sequence_parallel", False)) or (' in lines[353]
    assert 'config.qk_layernorm and ("q_layernorm" in name or "k_layernorm" in name)' in lines[354]
    enclosing = next(line for line in reversed(lines[:354]) if line.startswith("def "))
    assert enclosing.startswith("def _allreduce_non_tensor_model_parallel_grads("), enclosing
    body = "\n".join(lines[354:390])
    assert "ReduceOp.SUM" in body and "group=tp_group" in body
    # and finalize_model_grads, which megamu's GPU optimiser calls, runs it with the model's own config
    finalize = "\n".join(lines[lines.index("def finalize_model_grads("):])
    assert "config = get_model_config(model[0])" in finalize
    assert "_allreduce_non_tensor_model_parallel_grads(model, config, tp_group)" in finalize


def test_sequence_parallelism_at_tp_1_raises():
    line = _line("megatron.core.model_parallel_config", 411)
    assert 'raise ValueError("Cannot use sequence parallelism without tensor parallelism")' in line, line


@pytest.mark.parametrize("module, lineno, function", [
    ("megatron.core.tensor_parallel.mappings", 141, "_gather_along_first_dim"),
    ("megatron.core.tensor_parallel.mappings", 181, "_reduce_scatter_along_first_dim"),
    ("megatron.core.tensor_parallel.layers", 552, "backward"),
])
def test_sp_collectives_allocate_on_the_cuda_device(module, lineno, function):
    lines = _lines(module)
    assert "device=torch.cuda.current_device()" in lines[lineno - 1], lines[lineno - 1]
    enclosing = next(line.strip() for line in reversed(lines[:lineno]) if line.strip().startswith("def "))
    assert enclosing.startswith(f"def {function}("), enclosing


def test_gpt_models_own_selection_under_sp_gathers_and_turns_the_output_layers_sp_off():
    lines = _lines("megatron.core.models.gpt.gpt_model")
    assert "if self.output_layer.sequence_parallel:" in lines[667]
    assert "hidden_states = gather_from_sequence_parallel_region(" in lines[671]
    assert "self.output_layer.sequence_parallel = False" in lines[674]
