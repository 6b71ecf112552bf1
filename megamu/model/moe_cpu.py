"""The one override megamu applies to megatron-core for mixture-of-experts layers on CPU.

megatron-core 0.16.1 runs a local-spec MoE layer (``SequentialMLP`` experts, the ``allgather`` dispatcher) on CPU
except for its router's gate, which refuses CPU twice:

- ``transformer/moe/router.py:88-92``, ``Router.gating``: a router weight (or bias) on CPU is moved to
  ``torch.cuda.current_device()`` on every forward ("Torch not compiled with CUDA enabled");
- ``transformer/moe/moe_utils.py:1192`` (and ``:1225`` in the backward), ``RouterGatingLinearFunction``: tests
  ``te_general_gemm is not None``, a name only bound when Transformer Engine imports, so without TE: NameError.

``CpuTopKRouter`` replaces only ``gating`` (the gate's matmul, in ``moe_router_dtype`` as megatron's does): routing,
top-k, score function and token dispatch stay megatron's. It is put into the layer spec through
``MoESubmodules.router`` (``transformer/moe/moe_layer.py:75``, the router builder field that megatron-core's own specs
fill with ``TopKRouter``), by ``megamu.model.spec.moe_layer_spec`` on the local spec only: the GPU (Transformer Engine)
spec keeps megatron's router untouched.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.transformer.moe.router import TopKRouter

_ROUTER_DTYPES = {"fp32": torch.float32, "fp64": torch.float64}


class CpuTopKRouter(TopKRouter):
    """megatron's TopKRouter with a gate that stays on the weight's device and uses plain torch autograd."""

    def gating(self, input: torch.Tensor) -> torch.Tensor:
        # megatron's RouterGatingLinearFunction computes input @ weight.T (+ bias) in the router dtype
        # (moe_router_dtype, else the input's); F.linear does the same and differentiates itself
        dtype = _ROUTER_DTYPES.get(self.config.moe_router_dtype, input.dtype)
        bias = None if self.bias is None else self.bias.to(dtype)
        return F.linear(input.to(dtype), self.weight.to(dtype), bias)
