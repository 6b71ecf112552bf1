"""Layer specs: how the CPU ("local") and GPU ("transformer_engine") models differ (the default follows the Device).

local: megatron's local spec with a portable core attention that applies RoPE itself (megatron's RotaryEmbedding and
DotProductAttention allocate on CUDA), causal, GQA, torch SDPA, and megamu's ``RMSNorm`` for every norm (the layers',
the q/k norms and the decoder's final one), which sequence parallelism can run. transformer_engine: TE's fused layers
with megatron's native RoPE, whose inverse frequencies we overwrite with HF's exact formula (megatron hard-codes llama3
constants).
"""

from __future__ import annotations

import functools
import math
import re

import torch
import torch.nn.functional as F

from megamu.model.config import ModelArch

IMPLS = ("local", "transformer_engine")

# TE fuses the pre-attention / pre-MLP norms into the following linear layer; canonical names are the local spec's.
_TE_TO_LOCAL = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
}


# TEGroupedMLP (GPU experts) holds each linear of its E/EP local experts as one TE GroupedLinear whose parameters
# are weight0..weight<E/EP - 1> (megatron/core/extensions/transformer_engine.py, TEGroupedLinear's sharded state
# dict reads ``weight{gemm_idx}`` for local expert gemm_idx); SequentialMLP (CPU) names them
# local_experts.<j>.linear_fc*.weight. Canonical names are SequentialMLP's, with the same local index j.
_GROUPED_EXPERT = re.compile(r"\.mlp\.experts\.(linear_fc[12])\.weight(\d+)$")


def canonical_param_name(name: str) -> str:
    """Local-spec parameter name for a parameter of either spec (wrappers like Float16Module stripped by caller)."""
    for te, local in _TE_TO_LOCAL.items():
        if name.endswith(te):
            return name[: -len(te)] + local
    m = _GROUPED_EXPERT.search(name)
    if m:
        return f"{name[: m.start()]}.mlp.experts.local_experts.{m.group(2)}.{m.group(1)}.weight"
    return name


def rope_inv_freq(arch: ModelArch) -> torch.Tensor:
    """HF's inverse frequencies (default or llama3 scaling), computed exactly as transformers does, in fp32."""
    dim = arch.head_dim
    inv_freq = 1.0 / (arch.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
    s = arch.rope_scaling
    if s is None:
        return inv_freq
    factor, low, high, old_ctx = (
        s["factor"], s["low_freq_factor"], s["high_freq_factor"], s["original_max_position_embeddings"]
    )
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_ctx / low, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old_ctx / high) * ~(wavelen > old_ctx / low)
    return torch.where(medium, smoothed, scaled)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class PortableAttention(torch.nn.Module):
    """GQA attention with HF-convention (non-interleaved) RoPE applied inside, on torch SDPA.

    Without an attention mask: causal, positions 0..s-1 for every sequence (right padding is safe: causality keeps
    real tokens from seeing it; left padding is not supported). With a mask (megatron's convention: bool
    [b, 1, s, s], True = masked out): the mask must let each token see exactly the tokens before it in its own
    sequence, itself included, as when several responses follow one shared prompt in a row (see
    ``megamu.training.batch``). A token's position is then the number of tokens it sees, minus one.
    """

    def __init__(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=None,
                 softmax_scale=None, cp_comm_type=None, pg_collection=None, *, arch: ModelArch):
        super().__init__()
        self.config = config
        self.scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(config.kv_channels)
        # a plain attribute, not a buffer: Float16Module's .bfloat16() would round the frequencies (RoPE off HF's)
        self.inv_freq = rope_inv_freq(arch)

    def _rope(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:  # x: [s, b, heads, d]; pos: [s, b] or [s, 1]
        if self.inv_freq.device != x.device:
            self.inv_freq = self.inv_freq.to(x.device)
        freqs = pos.to(torch.float)[:, :, None] * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)[:, :, None, :]
        cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
        return x * cos + _rotate_half(x) * sin

    def forward(self, query, key, value, attention_mask=None, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if packed_seq_params is not None:
            raise NotImplementedError("PortableAttention does not support packed sequences")
        if attention_mask is None:
            pos = torch.arange(query.shape[0], device=query.device)[:, None]
            visible = None
        else:
            visible = ~attention_mask
            pos = visible.sum(-1)[:, 0].T - 1  # [s, b]
        q, k = self._rope(query, pos), self._rope(key, pos)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, value))  # [b, heads, s, d]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=visible, is_causal=visible is None, scale=self.scale,
                                             enable_gqa=q.shape[1] != k.shape[1])
        s, b = query.shape[0], query.shape[1]
        return out.permute(2, 0, 1, 3).reshape(s, b, -1)


class RMSNorm(torch.nn.RMSNorm):
    """The local spec's norm: the module megatron's ``WrappedTorchNorm`` builds (torch's RMSNorm, fp32 weight), minus
    its refusal of sequence parallelism (0.16.1 ``transformer/torch_norm.py:32``).

    RMSNorm is per token, so SP (each TP rank normalises its own s/TP tokens) leaves its math as it is. Its weight is
    replicated over TP, and under SP each rank sees only its own tokens: its gradient is a partial sum per rank. It
    is marked ``sequence_parallel`` as megatron's own norms mark theirs (``fusions/fused_layer_norm.py:119``; TE's
    norms take ``sequence_parallel=config.sequence_parallel``, ``extensions/transformer_engine.py:449/:460``), the
    mark the TP all-reduce of those gradients reads (``distributed/finalize_model_grads.py:354`` on GPU,
    ``megamu.model.build.allreduce_tp_partial_grads`` on CPU)."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_unused):
        if config.normalization != "RMSNorm":
            raise ValueError(f"megamu's local spec runs RMSNorm models, got normalization={config.normalization!r}")
        super().__init__(normalized_shape=hidden_size, eps=eps)
        self.weight.sequence_parallel = config.sequence_parallel


def _local_norms(spec) -> None:
    """Every norm of a local-spec layer made megamu's ``RMSNorm`` (q/k norms only where the arch has them)."""
    from megatron.core.transformer.identity_op import IdentityOp

    layer = spec.submodules
    layer.input_layernorm = layer.pre_mlp_layernorm = RMSNorm
    attention = layer.self_attention.submodules
    for name in ("q_layernorm", "k_layernorm"):
        if getattr(attention, name) is not IdentityOp:
            setattr(attention, name, RMSNorm)


def decoder_spec(arch: ModelArch, transformer_impl: str):
    """GPTModel's ``transformer_layer_spec``: the layer spec, and on the local spec the decoder block's submodules
    with megamu's ``RMSNorm`` as the final norm (given a layer spec alone, megatron's TransformerBlock builds its
    final norm from its own module-level choice, ``WrappedTorchNorm`` without TE or apex:
    ``transformer/transformer_block.py:258``)."""
    spec = layer_spec(arch, transformer_impl)
    if transformer_impl != "local":
        return spec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    return TransformerBlockSubmodules(layer_specs=[spec] * arch.num_layers, layer_norm=RMSNorm)


def layer_spec(arch: ModelArch, transformer_impl: str):
    if arch.num_experts and transformer_impl in IMPLS:
        spec = moe_layer_spec(arch, transformer_impl)
        if transformer_impl == "local":
            spec.submodules.self_attention.submodules.core_attention = functools.partial(PortableAttention, arch=arch)
            _local_norms(spec)
        return spec
    if transformer_impl == "local":
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

        spec = get_gpt_layer_local_spec(qk_layernorm=arch.qk_norm, normalization="RMSNorm")
        spec.submodules.self_attention.submodules.core_attention = functools.partial(PortableAttention, arch=arch)
        _local_norms(spec)
        return spec
    if transformer_impl == "transformer_engine":
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        return get_gpt_layer_with_transformer_engine_spec(qk_layernorm=arch.qk_norm)
    raise ValueError(f"--transformer-impl {transformer_impl!r} is not supported; expected one of {IMPLS}")


def moe_layer_spec(arch: ModelArch, transformer_impl: str):
    """megatron-core's GPT layer spec with MoE layers, as ``megamu.model.config.moe_impl`` decides."""
    from megatron.core.models.gpt import gpt_layer_specs

    from megamu.model.config import moe_impl

    impl = moe_impl(transformer_impl)
    if transformer_impl == "transformer_engine":
        spec = gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(
            num_experts=arch.num_experts, moe_grouped_gemm=impl.grouped_gemm, qk_layernorm=arch.qk_norm)
    else:
        spec = gpt_layer_specs.get_gpt_layer_local_spec(
            num_experts=arch.num_experts, moe_grouped_gemm=impl.grouped_gemm, qk_layernorm=arch.qk_norm,
            normalization="RMSNorm")
    if impl.cpu_router:
        from megamu.model.moe_cpu import CpuTopKRouter

        spec.submodules.mlp.submodules.router = CpuTopKRouter
    return spec


def position_embedding_kwargs(arch: ModelArch, transformer_impl: str) -> dict:
    """GPTModel kwargs for positions: none on CPU (RoPE lives in PortableAttention), megatron RoPE with TE."""
    if transformer_impl == "local":
        return {"position_embedding_type": "none"}
    return {"position_embedding_type": "rope", "rotary_percent": 1.0, "rotary_base": int(arch.rope_theta)}


def finalize(model, arch: ModelArch, transformer_impl: str) -> None:
    """Make megatron's RoPE use HF's inverse frequencies (its llama3 scaling fixes low/high/context constants)."""
    rope = getattr(model, "rotary_pos_emb", None)
    if transformer_impl == "transformer_engine" and rope is not None:
        rope.inv_freq = rope_inv_freq(arch).to(rope.inv_freq.device)
