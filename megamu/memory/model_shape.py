"""A decoder's shape as an HF config.json gives it, and its parameter counts: pure arithmetic for the memory plan.

Dense (Llama / Qwen2 / Qwen3) and mixture-of-experts (Qwen3-MoE: every layer's MLP is ``num_experts`` SwiGLU experts
of width ``moe_ffn_hidden_size`` and a router, each token going to ``moe_top_k`` of them; no shared expert).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from megamu.errors import ConfigError


def require_positive(name: str, value, kind=int) -> None:
    if not isinstance(value, kind) or isinstance(value, bool) or value <= 0:
        raise ConfigError(name, f"must be a positive {kind.__name__}, got {value!r}")


# MoE layouts the counts do not cover: DeepSeek's routed + shared experts and MLA, Qwen2-MoE's shared expert, stacks
# mixing dense and sparse layers
_UNMODELLED_MOE = {
    "n_routed_experts": "DeepSeek-style routed + shared experts are not modelled",
    "shared_expert_intermediate_size": "shared experts are not modelled",
    "mlp_only_layers": "stacks mixing dense and MoE layers are not modelled",
}


@dataclass(frozen=True)
class ModelShape:
    """The decoder's shape, as an HF config of the Llama / Qwen2 / Qwen3 / Qwen3-MoE family gives it."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_hidden_size: int  # the dense MLP's width (unused by an MoE model's layers)
    vocab_size: int
    tie_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2: q/k/v biases
    qk_norm: bool = False  # Qwen3: per-head RMSNorm on q and k
    num_experts: int = 0  # 0: dense
    moe_top_k: int = 0
    moe_ffn_hidden_size: int = 0

    def __post_init__(self) -> None:
        for name in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim", "ffn_hidden_size",
                     "vocab_size"):
            require_positive(name, getattr(self, name))
        if self.num_heads % self.num_kv_heads:
            raise ConfigError("num_kv_heads", f"{self.num_kv_heads} does not divide num_heads={self.num_heads}")
        if self.num_experts:
            for name in ("num_experts", "moe_top_k", "moe_ffn_hidden_size"):
                require_positive(name, getattr(self, name))
            if self.moe_top_k > self.num_experts:
                raise ConfigError("moe_top_k", f"{self.moe_top_k} exceeds num_experts={self.num_experts}")

    @classmethod
    def from_hf_config(cls, config: Mapping) -> ModelShape:
        """From an HF config.json's dict. MoE layouts other than Qwen3-MoE's are refused (``_UNMODELLED_MOE``)."""
        for key, why in _UNMODELLED_MOE.items():
            if config.get(key):
                raise ConfigError("model", f"{key}={config[key]}: {why}")
        if config.get("decoder_sparse_step", 1) != 1:
            raise ConfigError("model", f"decoder_sparse_step={config['decoder_sparse_step']}: "
                                       f"{_UNMODELLED_MOE['mlp_only_layers']}")
        heads = config["num_attention_heads"]
        experts = config.get("num_experts") or config.get("num_local_experts") or 0
        moe = {"num_experts": experts, "moe_top_k": config["num_experts_per_tok"],
               "moe_ffn_hidden_size": config["moe_intermediate_size"]} if experts else {}
        return cls(
            hidden_size=config["hidden_size"], num_layers=config["num_hidden_layers"], num_heads=heads,
            num_kv_heads=config.get("num_key_value_heads") or heads,
            head_dim=config.get("head_dim") or config["hidden_size"] // heads,
            ffn_hidden_size=config["intermediate_size"], vocab_size=config["vocab_size"],
            tie_embeddings=bool(config.get("tie_word_embeddings", False)),
            qkv_bias=config.get("model_type") == "qwen2", qk_norm=config.get("model_type") in ("qwen3", "qwen3_moe"),
            **moe,
        )

    @property
    def q_width(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_width(self) -> int:  # K and V together
        return 2 * self.num_kv_heads * self.head_dim

    @property
    def active_ffn_width(self) -> int:
        """The MLP width one token passes through: the dense MLP's, or its k experts' together."""
        return self.moe_top_k * self.moe_ffn_hidden_size if self.num_experts else self.ffn_hidden_size

    def param_counts(self, tp: int = 1, vocab: int | None = None) -> tuple[int, int]:
        """(parameters split over TP, parameters every TP rank holds whole) of the whole model but its experts
        (``expert_params``), for a vocab of ``vocab`` rows (default: the HF vocab; megatron pads it, see
        ``padded_vocab``). Per rank: split / tp + whole. An MoE layer's router is whole on every rank."""
        h, f, q, kv = self.hidden_size, self.ffn_hidden_size, self.q_width, self.kv_width
        v = self.vocab_size if vocab is None else vocab
        mlp = 0 if self.num_experts else 3 * h * f
        layer_split = h * (q + kv) + q * h + mlp + (q + kv if self.qkv_bias else 0)
        layer_whole = 2 * h + (2 * self.head_dim if self.qk_norm else 0) + self.num_experts * h
        split = self.num_layers * layer_split + v * h * (1 if self.tie_embeddings else 2)
        return split, self.num_layers * layer_whole + h

    def expert_params(self) -> int:
        """Every expert's SwiGLU (gate, up, down) in every layer: split over expert-parallel ranks (whole experts),
        each expert over the expert-TP ranks (megatron's default: the TP size)."""
        return self.num_layers * self.num_experts * 3 * self.hidden_size * self.moe_ffn_hidden_size

    def num_parameters(self) -> int:
        split, whole = self.param_counts()
        return split + whole + self.expert_params()


def padded_vocab(vocab_size: int, tp: int, divisible_by: int = 128) -> int:
    """Megatron's padding: a multiple of 128 x TP (same rule as megamu.model.config.padded_vocab_size)."""
    return math.ceil(vocab_size / (divisible_by * tp)) * divisible_by * tp
