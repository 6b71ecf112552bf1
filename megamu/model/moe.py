"""Mixture-of-experts layers: the one device decision of how megatron-core runs them, and its config fields.

CPU (local spec): ``SequentialMLP`` experts (one plain MLP per expert: megatron's grouped GEMM needs CUDA kernels),
the ``allgather`` token dispatcher (``alltoall`` creates a CUDA stream, ``transformer/moe/token_dispatcher.py:445``)
and megamu's CPU router (``megamu.model.moe_cpu``). GPU (Transformer Engine): grouped-GEMM experts, the ``alltoall``
dispatcher Megatron-LM uses with expert parallelism, megatron's own router.

Router settings follow HF's Qwen3-MoE (softmax over all experts, then top-k; ``norm_topk_prob`` renormalises the k
weights): megatron's ``moe_router_pre_softmax=False`` takes the top-k logits and softmaxes those, which equals
normalised top-k probabilities; ``pre_softmax=True`` softmaxes all logits, then takes the top k, unnormalised.
No load-balancing loss: μ-GRPO's loss is the policy objective alone (HF adds its aux loss only when asked for
router logits).
"""

from __future__ import annotations

from dataclasses import dataclass

from megamu.model.config import ModelArch

DISPATCHERS = ("allgather", "alltoall")


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


def moe_config_fields(arch: ModelArch, transformer_impl: str) -> dict:
    """TransformerConfig fields of an MoE arch (none for a dense one)."""
    if not arch.num_experts:
        return {}
    impl = moe_impl(transformer_impl)
    return {
        "num_moe_experts": arch.num_experts,
        "moe_router_topk": arch.moe_top_k,
        "moe_ffn_hidden_size": arch.moe_ffn_hidden_size,
        "moe_router_score_function": "softmax",
        "moe_router_pre_softmax": not arch.moe_norm_topk_prob,
        "moe_router_load_balancing_type": "none",
        "moe_aux_loss_coeff": 0.0,
        "moe_router_dtype": "fp32",  # HF's Qwen3-MoE softmaxes the router logits in fp32
        "moe_grouped_gemm": impl.grouped_gemm,
        "moe_token_dispatcher_type": impl.token_dispatcher,
    }


def moe_layer_spec(arch: ModelArch, transformer_impl: str):
    """megatron-core's GPT layer spec with MoE layers, as ``moe_impl`` decides."""
    from megatron.core.models.gpt import gpt_layer_specs

    impl = moe_impl(transformer_impl)
    if transformer_impl == "transformer_engine":
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(
            num_experts=arch.num_experts, moe_grouped_gemm=impl.grouped_gemm, qk_layernorm=arch.qk_norm)
    from megamu.model.moe_cpu import CpuTopKRouter

    spec = gpt_layer_specs.get_gpt_layer_local_spec(num_experts=arch.num_experts, moe_grouped_gemm=impl.grouped_gemm,
                                                    qk_layernorm=arch.qk_norm, normalization="RMSNorm")
    spec.submodules.mlp.submodules.router = CpuTopKRouter
    return spec
