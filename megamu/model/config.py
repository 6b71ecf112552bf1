"""The architecture of a supported HF causal LM, and the megatron-core TransformerConfig built from it."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from megamu.errors import ConfigError
from megamu.model.moe_settings import MoeSettings

FAMILIES = ("llama", "qwen2", "qwen3", "qwen3_moe")
MOE_FAMILIES = ("qwen3_moe",)
ROPE_TYPES = ("default", "llama3")
LLAMA3_ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


@dataclass
class ModelArch:
    family: str  # one of FAMILIES
    vocab_size: int  # true vocab (HF); the model pads it per TP size, see padded_vocab_size
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_hidden_size: int
    rope_theta: float
    rope_scaling: dict | None  # None or {"rope_type": "llama3", "factor", "low_freq_factor", ...}
    norm_eps: float
    qkv_bias: bool
    qk_norm: bool
    tie_embeddings: bool
    max_position_embeddings: int
    # mixture of experts (MOE_FAMILIES; 0 = dense): every layer's MLP is num_experts experts of moe_ffn_hidden_size,
    # each token routed to moe_top_k of them; moe_norm_topk_prob: the k routing weights renormalised to sum to 1
    num_experts: int = 0
    moe_top_k: int = 0
    moe_ffn_hidden_size: int = 0
    moe_norm_topk_prob: bool = False

    @classmethod
    def from_hf(cls, config_or_dir: Any) -> ModelArch:
        """From a transformers config object, or a folder / config.json path. Unsupported settings raise ValueError."""
        cfg = config_or_dir
        if isinstance(cfg, (str, Path)):
            from transformers import AutoConfig

            path = Path(cfg)
            cfg = AutoConfig.from_pretrained(path.parent if path.name == "config.json" else path)
        family = getattr(cfg, "model_type", None)
        if family not in FAMILIES:
            raise ValueError(f"config.model_type={family!r} is not supported; expected one of {FAMILIES}")

        def reject(field: str, bad) -> None:
            value = getattr(cfg, field, None)
            if value is not None and bad(value):
                raise ValueError(f"{family} config.{field}={value!r} is not supported")

        reject("hidden_act", lambda v: v != "silu")
        reject("mlp_bias", bool)
        reject("use_sliding_window", bool)
        if family != "qwen2":  # Qwen2 always has q/k/v biases (its config has no flag); others must have none
            reject("attention_bias", bool)
        rope = dict(getattr(cfg, "rope_parameters", None) or {})
        if not rope:  # transformers 4.x
            rope = dict(getattr(cfg, "rope_scaling", None) or {}, rope_theta=getattr(cfg, "rope_theta", 10000.0))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ROPE_TYPES:
            raise ValueError(f"{family} config.rope_parameters.rope_type={rope_type!r} is not supported; {ROPE_TYPES}")
        if rope.get("partial_rotary_factor", 1.0) != 1.0:
            raise ValueError(f"{family} config.rope_parameters.partial_rotary_factor={rope['partial_rotary_factor']} "
                             "is not supported")
        scaling = None
        if rope_type == "llama3":
            missing = [k for k in LLAMA3_ROPE_KEYS if k not in rope]
            if missing:
                raise ValueError(f"{family} config.rope_parameters (llama3) lacks {missing}")
            scaling = {"rope_type": "llama3", **{k: rope[k] for k in LLAMA3_ROPE_KEYS}}
        moe = _moe_fields(cfg, family, reject) if family in MOE_FAMILIES else {}
        heads = cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        return cls(
            family=family,
            vocab_size=cfg.vocab_size,
            hidden_size=cfg.hidden_size,
            num_layers=cfg.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=getattr(cfg, "num_key_value_heads", None) or heads,
            head_dim=head_dim,
            ffn_hidden_size=cfg.intermediate_size,
            rope_theta=float(rope.get("rope_theta", 10000.0)),
            rope_scaling=scaling,
            norm_eps=cfg.rms_norm_eps,
            qkv_bias=family == "qwen2",
            qk_norm=family in ("qwen3", "qwen3_moe"),
            tie_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
            max_position_embeddings=cfg.max_position_embeddings,
            **moe,
        )

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> ModelArch:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"ModelArch: unknown fields {unknown}")
        return cls(**d)

    def check_tp(self, tp: int) -> None:
        """TP splits whole KV groups (megatron's grouped QKV layout) and the SwiGLU width."""
        for field in ("num_heads", "num_kv_heads", "ffn_hidden_size", "moe_ffn_hidden_size"):
            if getattr(self, field) % tp:
                raise ValueError(f"{self.family}: {field}={getattr(self, field)} is not divisible by TP={tp}")


def _moe_fields(cfg: Any, family: str, reject) -> dict:
    """Qwen3-MoE: every layer sparse (megamu builds no mixed dense/MoE stacks), no shared expert."""
    reject("mlp_only_layers", bool)
    reject("decoder_sparse_step", lambda v: v != 1)
    reject("shared_expert_intermediate_size", bool)
    experts = getattr(cfg, "num_experts", None) or getattr(cfg, "num_local_experts", None)
    if not experts:
        raise ValueError(f"{family} config has no num_experts")
    return {"num_experts": int(experts), "moe_top_k": int(cfg.num_experts_per_tok),
            "moe_ffn_hidden_size": int(cfg.moe_intermediate_size),
            "moe_norm_topk_prob": bool(getattr(cfg, "norm_topk_prob", False))}


def padded_vocab_size(vocab_size: int, tp: int, divisible_by: int = 128) -> int:
    """Megatron's rule: pad the vocab to a multiple of divisible_by * TP so every rank holds an equal slice."""
    multiple = divisible_by * tp
    return int(math.ceil(vocab_size / multiple) * multiple)


RECOMPUTE_GRANULARITIES = ("full", "selective")


def recompute_fields(granularity: str | None) -> dict:
    """TransformerConfig fields for a recompute granularity: "full" recomputes every layer in the backward
    (Megatron-LM's usual --recompute-method uniform --recompute-num-layers 1), "selective" only the core attention
    (megatron-core's default recompute_modules), the part whose activations grow with the square of the length."""
    if granularity is None:
        return {}
    if granularity not in RECOMPUTE_GRANULARITIES:
        raise ConfigError("recompute_granularity", f"{granularity!r}: expected one of {RECOMPUTE_GRANULARITIES}")
    if granularity == "full":
        return {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
    return {"recompute_granularity": "selective"}


FUSIONS = ("bias_activation_fusion", "bias_dropout_fusion", "masked_softmax_fusion", "apply_rope_fusion",
           "gradient_accumulation_fusion")


def fusion_fields(transformer_impl: str) -> dict[str, bool]:
    """Megatron's kernel fusions, decided with the layer spec: on with Transformer Engine, as Megatron-LM's training
    defaults have them (fused SwiGLU, bias-dropout-add, masked softmax, TE's fused RoPE, weight gradients accumulated
    inside the GEMM into the DDP buffer's main_grad); all off on the local spec, whose CPU path has none of those
    kernels (PortableAttention applies RoPE and softmax itself).

    Weight-gradient fusion also covers megatron's own output layer (a ColumnParallelLinear), which needs apex's
    fused_weight_gradient_mlp_cuda and refuses to build without it; the TE layers do it natively. So it is on only
    where that extension imports (the image's optional apex), as Megatron-LM users turn it off without apex."""
    if transformer_impl == "local":
        return dict.fromkeys(FUSIONS, False)
    if transformer_impl != "transformer_engine":
        raise ValueError(f"--transformer-impl {transformer_impl!r} is not supported; expected local or "
                         "transformer_engine")
    import importlib.util

    fields = dict.fromkeys(FUSIONS, True)
    fields["gradient_accumulation_fusion"] = importlib.util.find_spec("fused_weight_gradient_mlp_cuda") is not None
    return fields


# Mixture-of-experts layers: the one device decision of how megatron-core runs them (the layer spec, in
# megamu.model.spec.moe_layer_spec, follows it), and their TransformerConfig fields.
#
# CPU (local spec): ``SequentialMLP`` experts (one plain MLP per expert: megatron's grouped GEMM needs CUDA kernels),
# the ``allgather`` token dispatcher (``alltoall`` creates a CUDA stream, ``transformer/moe/token_dispatcher.py:445``)
# and megamu's CPU router (``megamu.model.moe_cpu``). GPU (Transformer Engine): grouped-GEMM experts, the ``alltoall``
# dispatcher Megatron-LM uses with expert parallelism, megatron's own router.
#
# Router settings follow HF's Qwen3-MoE (softmax over all experts, then top-k; ``norm_topk_prob`` renormalises the k
# weights): megatron's ``moe_router_pre_softmax=False`` takes the top-k logits and softmaxes those, which equals
# normalised top-k probabilities; ``pre_softmax=True`` softmaxes all logits, then takes the top k, unnormalised.
# No load-balancing loss by default: μ-GRPO's loss is the policy objective alone (HF adds its aux loss only when
# asked for router logits); --moe-router-load-balancing-type / --moe-aux-loss-coeff turn megatron's own on.
@dataclass(frozen=True)
class MoeImpl:
    grouped_gemm: bool  # TEGroupedMLP experts (GPU) vs SequentialMLP (CPU)
    token_dispatcher: str  # megatron's moe_token_dispatcher_type
    cpu_router: bool  # megamu.model.moe_cpu.CpuTopKRouter in place of megatron's TopKRouter


def moe_impl(transformer_impl: str) -> MoeImpl:
    """The device decision for MoE layers, made with the layer spec (``transformer_impl``)."""
    if transformer_impl == "local":
        return MoeImpl(grouped_gemm=False, token_dispatcher="allgather", cpu_router=True)
    if transformer_impl == "transformer_engine":
        return MoeImpl(grouped_gemm=True, token_dispatcher="alltoall", cpu_router=False)
    raise ValueError(f"--transformer-impl {transformer_impl!r} is not supported; expected local or transformer_engine")


MOE_LOAD_BALANCING = ("none", "aux_loss", "seq_aux_loss", "global_aux_loss")  # megatron's aux-loss types


def check_load_balancing(kind: str, coeff: float) -> None:
    """A load-balancing type and its coefficient come together: megatron adds no loss at coefficient 0, and a
    coefficient without a type would be ignored."""
    if kind not in MOE_LOAD_BALANCING:
        raise ConfigError("moe_router_load_balancing_type", f"{kind!r}: expected one of {MOE_LOAD_BALANCING}")
    if coeff < 0 or (kind == "none") != (coeff == 0):
        raise ConfigError("moe_aux_loss_coeff", f"{coeff} with load-balancing type {kind!r}: give a coefficient > 0 "
                                                "with a type, 0 with none")


def moe_config_fields(arch: ModelArch, transformer_impl: str, load_balancing: tuple[str, float] = ("none", 0.0),
                      settings: MoeSettings | None = None) -> dict:
    """TransformerConfig fields of an MoE arch (none for a dense one). ``settings``: the launch's Megatron-LM MoE flags
    (megamu.model.moe_settings); where the device's layers lack a kernel they ask for (``moe_impl``: no grouped GEMM
    means the CPU spec), the device's choice stands."""
    if not arch.num_experts:
        return {}
    impl = moe_impl(transformer_impl)
    s = settings or MoeSettings()
    gpu_kernels = impl.grouped_gemm  # Transformer Engine's layers: its fused permutation and CUDA streams are there
    return {
        "num_moe_experts": arch.num_experts,
        "moe_router_topk": arch.moe_top_k,
        "moe_ffn_hidden_size": arch.moe_ffn_hidden_size,
        "moe_router_score_function": "softmax",
        "moe_router_pre_softmax": not arch.moe_norm_topk_prob,
        "moe_router_load_balancing_type": load_balancing[0],
        "moe_aux_loss_coeff": load_balancing[1],
        "moe_router_dtype": s.router_dtype,
        "moe_token_drop_policy": s.token_drop_policy,
        "moe_grouped_gemm": impl.grouped_gemm,
        "moe_token_dispatcher_type": s.token_dispatcher_type if gpu_kernels and s.token_dispatcher_type
        else impl.token_dispatcher,
        "moe_permute_fusion": s.permute_fusion and gpu_kernels,
    }


def scale_router_aux_loss(weight: float) -> None:
    """The gradient scale of MoE routers' aux loss in the next backward: megatron adds it through
    ``MoEAuxLossAutoScaler`` (transformer/moe/moe_utils.py), scaled by a class-wide value its own schedule sets per
    micro-batch (pipeline_parallel/schedules.py ``forward_step``: the loss scale / micro-batches). megamu's loop weights
    each micro-batch's policy loss by its share of the minibatch; the aux loss gets the same weight, so the update
    sees coeff x the minibatch's weighted mean of it. No effect without an aux loss."""
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(float(weight)))


def transformer_config(
    arch: ModelArch,
    *,
    tp: int,
    ep: int = 1,
    etp: int | None = None,
    params_dtype: torch.dtype = torch.float32,
    bf16: bool = False,
    transformer_impl: str = "local",
    perform_initialization: bool = True,
    recompute_granularity: str | None = None,
    use_cpu_initialization: bool = True,
    load_balancing: tuple[str, float] = ("none", 0.0),
    sequence_parallel: bool = False,
    moe: MoeSettings | None = None,
):
    from megatron.core.transformer import TransformerConfig

    arch.check_tp(tp)
    return TransformerConfig(
        **recompute_fields(recompute_granularity),
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        num_attention_heads=arch.num_heads,
        num_query_groups=arch.num_kv_heads,
        kv_channels=arch.head_dim,
        ffn_hidden_size=arch.ffn_hidden_size,
        normalization="RMSNorm",
        layernorm_epsilon=arch.norm_eps,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        add_qkv_bias=arch.qkv_bias,
        qk_layernorm=arch.qk_norm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=tp,
        # megatron's own SP: norms and residuals split over the TP ranks along the sequence (megatron raises
        # "Cannot use sequence parallelism without tensor parallelism" at TP 1, model_parallel_config.py:411)
        sequence_parallel=sequence_parallel,
        # the expert layout process groups were built with: TE's grouped linear marks expert weights as not
        # all-reduced over data parallel only when it reads EP > 1 here (extensions/transformer_engine.py); a dense
        # model has no experts to lay out (megatron refuses EP > 1 without num_moe_experts)
        expert_model_parallel_size=ep if arch.num_experts else 1,
        expert_tensor_parallel_size=etp if arch.num_experts else None,
        params_dtype=params_dtype,
        bf16=bf16,
        pipeline_dtype=params_dtype,
        use_cpu_initialization=use_cpu_initialization,
        perform_initialization=perform_initialization,
        **fusion_fields(transformer_impl),
        **moe_config_fields(arch, transformer_impl, load_balancing, moe),
    )
