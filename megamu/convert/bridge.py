"""HF <-> megatron through mbridge (PyPI ``mbridge``, the converter verl and slime use); HF <-> torch_dist
checkpoints that Megatron-LM loads are megamu.training.torch_dist's (they need the trainer's checkpoint).

mbridge maps a live megatron-core model's parameters to HF tensors and back, TP and EP aware, for every family it
registers (``supported_families()``: llama, qwen2, qwen3, qwen2_moe, qwen3_moe, mixtral, deepseek_v3, glm4_moe, gemma3
and more in 0.15.1). What megamu adds, and why:

- Layer-norm names. mbridge knows the norms by their Transformer Engine names (``linear_qkv.layer_norm_weight``,
  ``linear_fc1.layer_norm_weight``): TE fuses each norm into the next linear. The CPU (local) spec keeps them as
  modules, ``input_layernorm`` and ``pre_mlp_layernorm``, which mbridge 0.15.1 rejects ("Unsupported parameter
  name", core/bridge.py ``_weight_name_mapping_other`` / ``_weight_name_mapping_mlp``). Two name entries fix that.
- Expert names. mbridge 0.15.1 maps MoE experts by their grouped-GEMM names only (``mlp.experts.linear_fc1.weight<i>``,
  the TE spec's ``TEGroupedMLP``: the expert index is what follows "weight"). The CPU spec's ``SequentialMLP`` has one
  module per expert, ``mlp.experts.local_experts.<i>.linear_fc1.weight``, which mbridge would map to expert ""; a
  name entry gives it HF's ``mlp.experts.<i>.{gate,up,down}_proj``. Its TP split and merge are mbridge's own
  (fc1 by its "linear_fc1.weight" rule, fc2 along the parameter's partition dim). mbridge's expert-parallel index
  translation also keys on the grouped-GEMM names, so on the local spec this holds at EP=1 only (megamu builds no
  other; megatron-core 0.16.1 does not run EP on CPU anyway, see docs/checkpoints.md).
- Vocab padding. megamu pads the vocab to a multiple of 128 * TP (Megatron-LM's rule); mbridge pads only when its
  own model provider builds the model, so the bridge is told the padded size here.
- dtype. mbridge casts HF tensors to its ``dtype`` (bfloat16 unless told): the model's own dtype is passed.

megamu's own per-family mapping (megamu.convert.mapping) stays for the trainer's hot paths: loading the initial
policy from an HF folder and the HF export of every stage, tensor by tensor (the tests check the two agree bitwise).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch

from megamu.model import ModelArch, unwrap
from megamu.model.config import padded_vocab_size

_LOCAL_SPEC_NORMS = {  # local-spec parameter -> HF tensor (mbridge has these under their TE names only)
    "other": {"input_layernorm.weight": ["model.layers.{layer_number}.input_layernorm.weight"]},
    # "pre_mlp_layernorm" contains "mlp": mbridge looks it up among the MLP names
    "mlp": {"pre_mlp_layernorm.weight": ["model.layers.{layer_number}.post_attention_layernorm.weight"]},
}
_LOCAL_EXPERTS = {  # SequentialMLP's expert parameter -> HF tensors of expert {expert}
    "linear_fc1.weight": ["model.layers.{layer}.mlp.experts.{expert}.gate_proj.weight",
                          "model.layers.{layer}.mlp.experts.{expert}.up_proj.weight"],
    "linear_fc2.weight": ["model.layers.{layer}.mlp.experts.{expert}.down_proj.weight"],
}


def supported_families() -> list[str]:
    from mbridge import AutoBridge

    return AutoBridge.list_supported_models()


def bridge_for(model, arch: ModelArch, hf_dir: str | Path):
    """An mbridge Bridge for ``model`` (built by megamu.model.build_model at the current TP size) and the HF folder
    whose config describes it. Collective-free; call after megamu.runtime.parallel.init_distributed."""
    from mbridge import AutoBridge
    from megatron.core import parallel_state

    dtype = next(unwrap(model).parameters()).dtype
    bridge = AutoBridge.from_pretrained(str(hf_dir), dtype=dtype)
    tp = parallel_state.get_tensor_model_parallel_world_size()
    bridge.make_vocab_size_divisible_by = padded_vocab_size(arch.vocab_size, tp)  # any non-None value enables it
    bridge.vocab_size, bridge.padded_vocab_size = arch.vocab_size, padded_vocab_size(arch.vocab_size, tp)
    names = [n for n, _ in unwrap(model).named_parameters()]
    if any(n.endswith("input_layernorm.weight") for n in names):  # the local spec
        bridge._OTHER_MAPPING = {**bridge._OTHER_MAPPING, **_LOCAL_SPEC_NORMS["other"]}
        bridge._MLP_MAPPING = {**bridge._MLP_MAPPING, **_LOCAL_SPEC_NORMS["mlp"]}
    if any(".mlp.experts.local_experts." in n for n in names):
        _map_local_experts(bridge)
    return bridge


def _map_local_experts(bridge) -> None:
    """Name entries for SequentialMLP experts (module docstring), ahead of mbridge's grouped-GEMM ones."""
    from megatron.core import parallel_state

    if parallel_state.get_expert_model_parallel_world_size() != 1:
        raise NotImplementedError("mbridge maps SequentialMLP experts (the local spec) at expert-parallel size 1 only")
    grouped = bridge._weight_name_mapping_mlp

    def mapping(name: str) -> list[str]:
        if ".mlp.experts.local_experts." not in name:
            return grouped(name)
        layer = name.split(".")[2]  # decoder.layers.<layer>.mlp.experts.local_experts.<expert>.<suffix>
        expert, suffix = name.split(".local_experts.", 1)[1].split(".", 1)
        return [n.format(layer=layer, expert=expert) for n in _LOCAL_EXPERTS[suffix]]

    bridge._weight_name_mapping_mlp = mapping


@torch.no_grad()
def load_hf_via_mbridge(model, arch: ModelArch, hf_dir: str | Path) -> None:
    """HF weights into the live (TP-sharded) model through mbridge; collective over the TP group (TP rank 0 reads
    each tensor, one at a time, and scatters the slices)."""
    bridge_for(model, arch, hf_dir).load_weights([unwrap(model)], str(hf_dir), memory_efficient=True)


def hf_tensors_via_mbridge(model, arch: ModelArch, hf_dir: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, full tensor) of the live model, one at a time, through mbridge; every rank must iterate (each step
    gathers over TP). Tied embeddings give ``model.embed_tokens.weight`` only, as in the HF folder."""
    bridge = bridge_for(model, arch, hf_dir)
    with torch.no_grad():
        for name, tensor in bridge.export_weights([unwrap(model)]):
            yield name, tensor.detach()
