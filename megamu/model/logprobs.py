"""Per-token log-probs and entropy from vocab-parallel logits, exact forward and backward under TP.

Logits are divided by the sampling temperature first: SGLang reports log_softmax(logits / T), and the importance ratio
must compare like with like.
"""

from __future__ import annotations

import torch


def _vocab_parallel_entropy(z: torch.Tensor) -> torch.Tensor:
    """H = log S - sum_i p_i (z_i - m), with S = sum_i exp(z_i - m) over the whole (sharded) vocab."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.mappings import (
        copy_to_tensor_model_parallel_region,
        reduce_from_tensor_model_parallel_region,
    )

    group = parallel_state.get_tensor_model_parallel_group()
    m = z.detach().amax(dim=-1, keepdim=True)  # H does not depend on m: a constant shift for stability
    torch.distributed.all_reduce(m, op=torch.distributed.ReduceOp.MAX, group=group)
    shifted = z - m
    exp = shifted.exp()
    s_total = reduce_from_tensor_model_parallel_region(exp.sum(dim=-1, keepdim=True))
    # Each rank uses S in its own p_i: copy_to sums those gradient contributions across ranks in backward.
    # Without it the forward matches but gradients are off (~1e-3).
    p = exp / copy_to_tensor_model_parallel_region(s_total)
    # -inf logits (padded vocab entries) have p = 0: zero them so that p * z is 0, not nan, forward and backward
    shifted = shifted.masked_fill(torch.isneginf(shifted), 0.0)
    p_dot_z = reduce_from_tensor_model_parallel_region((p * shifted).sum(dim=-1))
    return s_total.squeeze(-1).log() - p_dot_z


def token_logprobs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log softmax(logits / T)[targets] and optionally the entropy of softmax(logits / T).

    logits: [b, s, V_padded / TP] (this rank's vocab shard; build_model's models give padded entries -inf, which
    keeps them out of both); targets: [b, s] global token ids. Returns fp32 [b, s] tensors.
    """
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    # at least fp32 (fp64 stays fp64); a fresh tensor, as vocab_parallel_cross_entropy edits it in place
    z = (logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature).contiguous()
    entropy = _vocab_parallel_entropy(z) if with_entropy else None
    logp = -vocab_parallel_cross_entropy(z.clone() if with_entropy else z, targets)
    return logp, entropy


def forward_logprobs(
    model,
    input_ids: torch.Tensor,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs of input_ids[:, 1:] given their prefixes ([b, s-1]), right padding assumed (positions 0..s-1)."""
    b, s = input_ids.shape
    position_ids = torch.arange(s, device=input_ids.device).unsqueeze(0).expand(b, s)
    # Causality is built into the attention; megatron wants a mask argument but our core attention ignores it.
    logits = model(input_ids, position_ids, None)
    return token_logprobs(logits[:, :-1], input_ids[:, 1:], temperature, with_entropy)
