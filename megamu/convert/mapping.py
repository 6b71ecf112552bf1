"""HF <-> canonical megatron ("mcore") tensor names and layouts, per model family. Pure tensor moves, no TP.

Canonical layout: local-spec parameter names, full tensors, true (unpadded) vocab rows, fc1 = cat(gate, up), QKV in
megatron's grouped layout (per KV group: its query heads, then its key head, then its value head).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

from megamu.model.config import ModelArch


@dataclass(frozen=True)
class Entry:
    mcore: str
    hf: tuple[str, ...]
    kind: str  # "copy" | "qkv" | "fc1"


def plan(arch: ModelArch) -> list[Entry]:
    """Every canonical tensor of ``arch`` and the HF tensors it is made of, in model order."""
    entries = [Entry("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), "copy")]
    for i in range(arch.num_layers):
        hf, mc = f"model.layers.{i}.", f"decoder.layers.{i}."
        attn = hf + "self_attn."
        entries.append(Entry(mc + "input_layernorm.weight", (hf + "input_layernorm.weight",), "copy"))
        entries.append(Entry(mc + "self_attention.linear_qkv.weight",
                             tuple(f"{attn}{p}_proj.weight" for p in "qkv"), "qkv"))
        if arch.qkv_bias:
            entries.append(Entry(mc + "self_attention.linear_qkv.bias",
                                 tuple(f"{attn}{p}_proj.bias" for p in "qkv"), "qkv"))
        if arch.qk_norm:
            entries.append(Entry(mc + "self_attention.q_layernorm.weight", (attn + "q_norm.weight",), "copy"))
            entries.append(Entry(mc + "self_attention.k_layernorm.weight", (attn + "k_norm.weight",), "copy"))
        entries.append(Entry(mc + "self_attention.linear_proj.weight", (attn + "o_proj.weight",), "copy"))
        entries.append(Entry(mc + "pre_mlp_layernorm.weight", (hf + "post_attention_layernorm.weight",), "copy"))
        if arch.num_experts:
            entries += _moe_entries(arch, hf, mc)
            continue
        entries.append(Entry(mc + "mlp.linear_fc1.weight",
                             (hf + "mlp.gate_proj.weight", hf + "mlp.up_proj.weight"), "fc1"))
        entries.append(Entry(mc + "mlp.linear_fc2.weight", (hf + "mlp.down_proj.weight",), "copy"))
    entries.append(Entry("decoder.final_layernorm.weight", ("model.norm.weight",), "copy"))
    if not arch.tie_embeddings:
        entries.append(Entry("output_layer.weight", ("lm_head.weight",), "copy"))
    return entries


def _moe_entries(arch: ModelArch, hf: str, mc: str) -> list[Entry]:
    """One MoE layer: the router (HF's ``mlp.gate``) and each expert's MLP. Canonical names are ``SequentialMLP``'s
    (the CPU spec's experts, ``mlp.experts.local_experts.<j>``) with the global expert index, i.e. at EP=1."""
    entries = [Entry(mc + "mlp.router.weight", (hf + "mlp.gate.weight",), "copy")]
    for j in range(arch.num_experts):
        src, dst = f"{hf}mlp.experts.{j}.", f"{mc}mlp.experts.local_experts.{j}."
        entries.append(Entry(dst + "linear_fc1.weight", (src + "gate_proj.weight", src + "up_proj.weight"), "fc1"))
        entries.append(Entry(dst + "linear_fc2.weight", (src + "down_proj.weight",), "copy"))
    return entries


# HF tensors we accept and drop: buffers some exporters write, and lm_head saved alongside tied embeddings.
def ignorable_hf(name: str, arch: ModelArch) -> bool:
    return name.endswith("rotary_emb.inv_freq") or (arch.tie_embeddings and name == "lm_head.weight")


def _qkv_split_sizes(arch: ModelArch) -> list[int]:
    per_group = arch.num_heads // arch.num_kv_heads
    return [per_group * arch.head_dim, arch.head_dim, arch.head_dim]


def fuse(entry: Entry, tensors: list[torch.Tensor], arch: ModelArch) -> torch.Tensor:
    if entry.kind == "copy":
        return tensors[0]
    if entry.kind == "fc1":
        return torch.cat(tensors, dim=0)
    g = arch.num_kv_heads
    q, k, v = (t.reshape(g, -1, *t.shape[1:]) for t in tensors)  # [groups, rows per group, (hidden)]
    return torch.cat((q, k, v), dim=1).reshape(-1, *tensors[0].shape[1:])


def split(entry: Entry, full: torch.Tensor, arch: ModelArch) -> list[torch.Tensor]:
    # clone: safetensors refuses to write tensors that share storage
    if entry.kind == "copy":
        return [full]
    if entry.kind == "fc1":
        return [t.clone() for t in full.chunk(2, dim=0)]
    grouped = full.reshape(arch.num_kv_heads, -1, *full.shape[1:])
    return [t.reshape(-1, *full.shape[1:]).clone() for t in grouped.split(_qkv_split_sizes(arch), dim=1)]


def check_hf_names(arch: ModelArch, hf_names: Iterable[str]) -> None:
    """Raise KeyError naming the missing / unexpected HF tensors and the family."""
    available = set(hf_names)
    wanted = {n for e in plan(arch) for n in e.hf}
    missing = sorted(wanted - available)
    unexpected = sorted(n for n in available - wanted if not ignorable_hf(n, arch))
    if missing or unexpected:
        raise KeyError(f"{arch.family} checkpoint does not match the architecture: missing HF tensors {missing}, "
                       f"unexpected HF tensors {unexpected}")


def mcore_to_hf_tensors(
    arch: ModelArch, items: Iterable[tuple[str, torch.Tensor]]
) -> Iterator[tuple[str, torch.Tensor]]:
    """HF tensors from canonical ones (in any order); raises KeyError on unknown or missing canonical names."""
    entries = {e.mcore: e for e in plan(arch)}
    seen = set()
    for name, full in items:
        e = entries.get(name)
        if e is None:
            raise KeyError(f"unexpected tensor {name!r} for a {arch.family} model")
        seen.add(name)
        yield from zip(e.hf, split(e, full, arch))
    missing = sorted(set(entries) - seen)
    if missing:
        raise KeyError(f"missing tensors for a {arch.family} model: {missing}")
