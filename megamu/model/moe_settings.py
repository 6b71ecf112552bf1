"""megatron-core's MoE settings a launch may give with Megatron-LM's flags (slime's ``scripts/models/qwen3-30B-A3B.sh``
passes them), beyond what the HF config fixes (expert count, top-k, widths: ``ModelArch``).

Each one is a ``TransformerConfig`` field of the same name (megatron-core 0.16.1 ``transformer/transformer_config.py``:
``moe_token_dispatcher_type`` :675, ``moe_router_dtype`` :629, ``moe_token_drop_policy`` :699, ``moe_permute_fusion``
:708, ``moe_grouped_gemm`` :649). What the device can run is decided once, by ``megamu.model.config.moe_impl``: the
CPU (local) spec has neither Transformer Engine's grouped GEMM nor its fused permutation, and runs the ``allgather``
dispatcher (``alltoall`` creates a CUDA stream, ``transformer/moe/token_dispatcher.py:445``), so there these settings
fall back to the CPU's (megamu.arguments prints a note naming each flag given). The router's score function and the
layers that are MoE are the HF config's to decide: megamu.arguments.model_args checks those flags against it.
"""

from __future__ import annotations

from dataclasses import dataclass

from megamu.config_fields import flag
from megamu.errors import check_choice

DISPATCHERS = ("allgather", "alltoall")  # megatron's "flex" needs DeepEP / HybridEP kernels megamu does not ship
ROUTER_DTYPES = ("fp32", "fp64")
DROP_POLICIES = ("probs", "position")


@dataclass(frozen=True)
class MoeSettings:
    token_dispatcher_type: str | None = flag(
        "--moe-token-dispatcher-type", default=None, choices=list(DISPATCHERS), help=(
            "megatron's MoE token dispatcher (default: alltoall on GPUs, as Megatron-LM runs expert parallelism; "
            "CPU runs use allgather)"))
    # HF's Qwen3-MoE softmaxes the router logits in fp32 (Megatron-LM leaves them in the params dtype unless told)
    router_dtype: str = flag("--moe-router-dtype", default="fp32", choices=list(ROUTER_DTYPES),
                             help="dtype of the router's gate and softmax (default fp32, as HF's Qwen3-MoE)")
    token_drop_policy: str = flag(
        "--moe-token-drop-policy", default="probs", choices=list(DROP_POLICIES), help=(
            "which tokens an expert over capacity drops (megatron's; megamu sets no capacity factor, so no token "
            "is dropped and the policy never applies, as in HF)"))
    grouped_gemm: bool = flag("--moe-grouped-gemm", default=False, action="store_true", help=(
        "Transformer Engine's grouped GEMM for the experts: megamu's GPU layers always use it; CPU runs use one "
        "MLP per expert (megatron's SequentialMLP)"))
    permute_fusion: bool = flag("--moe-permute-fusion", default=False, action="store_true", help=(
        "Transformer Engine's fused token permutation (GPU runs; not applied on CPU runs)"))

    def __post_init__(self):
        for name, choices in (("token_dispatcher_type", DISPATCHERS), ("router_dtype", ROUTER_DTYPES),
                              ("token_drop_policy", DROP_POLICIES)):
            if getattr(self, name) is not None:
                check_choice(self, name, choices)

    def cpu_fallbacks(self) -> list[str]:
        """The settings given that a CPU (local spec) run replaces by its own, one line each."""
        out = []
        if self.token_dispatcher_type == "alltoall":
            out.append("--moe-token-dispatcher-type alltoall: a CPU run dispatches with allgather (megatron-core's "
                       "alltoall dispatcher needs CUDA streams); GPU runs use alltoall")
        if self.grouped_gemm:
            out.append("--moe-grouped-gemm: a CPU run computes one MLP per expert (megatron's SequentialMLP, the same "
                       "weights); GPU runs use Transformer Engine's grouped GEMM")
        if self.permute_fusion:
            out.append("--moe-permute-fusion: Transformer Engine's fused permutation, GPU runs only (not applied on "
                       "CPU)")
        return out
