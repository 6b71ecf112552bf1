"""Per-token log-probs and entropy of a model's predictions, exact forward and backward under TP.

``score_tokens`` is the one function that turns a batch into log-probs (and entropy) for training, for the
trainer's log-prob recomputation and for the tests. It applies the output layer only at the positions it scores:
on a prompt-heavy batch most positions are prompt tokens whose predictions nobody reads.

Logits are divided by the sampling temperature first: SGLang reports log_softmax(logits / T), and the importance ratio
must compare like with like.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch


def token_logprobs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log softmax(logits / T)[targets] and optionally the entropy of softmax(logits / T), from one log-softmax.

    logits: [..., V_padded / TP] (this rank's vocab shard; build_model's models give padded entries -inf, which
    keeps them out of both); targets: [...] global token ids. Returns fp32 (fp64 stays fp64) tensors of targets' shape.

    With z this rank's shard, m the global max and S = sum_i exp(z_i - m) over the whole vocab:
    log p(t) = (z_t - m) - log S and H = log S - sum_i p_i (z_i - m). Three all-reduces in all (max; S and z_t
    together; sum p z). Replicated values that enter a per-rank computation go through
    ``copy_to_tensor_model_parallel_region``, which sums their gradient over the ranks in backward.
    """
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.mappings import (
        copy_to_tensor_model_parallel_region,
        reduce_from_tensor_model_parallel_region,
    )

    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    group = parallel_state.get_tensor_model_parallel_group()
    z = logits.to(torch.promote_types(logits.dtype, torch.float32))
    if temperature != 1.0:  # x / 1.0 is x exactly: skip a pass over [tokens, vocab] at the usual T = 1
        z = z / temperature
    local_vocab = z.shape[-1]
    start = parallel_state.get_tensor_model_parallel_rank() * local_vocab

    m = z.detach().amax(dim=-1, keepdim=True)  # the result does not depend on m: a constant shift for stability
    if parallel_state.get_tensor_model_parallel_world_size() > 1:
        torch.distributed.all_reduce(m, op=torch.distributed.ReduceOp.MAX, group=group)
    shifted = z - m
    exp = shifted.exp()
    local = targets - start
    here = (local >= 0) & (local < local_vocab)
    picked = shifted.gather(-1, local.clamp(0, local_vocab - 1).unsqueeze(-1)).squeeze(-1)
    picked = torch.where(here, picked, torch.zeros_like(picked))  # the target's logit lives on one rank
    s_total, z_target = reduce_from_tensor_model_parallel_region(
        torch.stack((exp.sum(dim=-1), picked), dim=-1)
    ).unbind(-1)
    log_s = s_total.log()
    logp = z_target - log_s
    if not with_entropy:
        return logp, None
    p = exp / copy_to_tensor_model_parallel_region(s_total).unsqueeze(-1)
    # -inf logits (padded vocab entries) have p = 0: zero them so that p * z is 0, not nan, forward and backward
    shifted = shifted.masked_fill(torch.isneginf(shifted), 0.0)
    p_dot_z = reduce_from_tensor_model_parallel_region((p * shifted).sum(dim=-1))
    return logp, log_s - p_dot_z


@contextmanager
def _output_layer_only_at(gpt, index: torch.Tensor):
    """Within the context, ``gpt``'s output layer reads only the hidden states at ``index`` ([n, w] flat indices into
    the decoder's [b * s] tokens), so the model returns logits [n, w, V/TP]. A forward pre-hook keeps everything else
    of megatron's output path: tied embedding weights, the padded-vocab -inf hook, Float16Module's fp32 cast.

    Under sequence parallelism the decoder hands each rank its s/TP positions, and the output layer would all-gather
    whatever it is given along dim 0: the hook gathers the positions itself first and the output layer runs as
    without SP for the context (as GPTModel does for its own last-token selection, models/gpt/gpt_model.py:668-696).
    That output layer sums the picked positions' gradient over TP (its copy-to-TP-region input), so every rank then
    holds the whole gradient and the gather's backward only keeps this rank's share (``tensor_parallel_output_grad=
    False``), where SP's own gather would reduce-scatter partial gradients."""
    from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

    layer = gpt.output_layer
    gather = layer.sequence_parallel

    def select(module, args, kwargs):
        hidden = args[0]  # [s, b, h] ([s/TP, b, h] under SP)
        if gather:
            hidden = gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=False)
        s, b, h = hidden.shape
        picked = hidden.transpose(0, 1).reshape(b * s, h)[index.reshape(-1)]
        return (picked.view(*index.shape, h).transpose(0, 1), *args[1:]), kwargs

    handle = layer.register_forward_pre_hook(select, with_kwargs=True)
    layer.sequence_parallel = False
    try:
        yield
    finally:
        layer.sequence_parallel = gather
        handle.remove()


def _pad_for_sequence_parallelism(gpt, input_ids, score_index, attention_mask):
    """Rows right-padded to a multiple of TP under sequence parallelism (megatron splits the sequence evenly over
    the TP ranks); unchanged otherwise. Padding comes after every real token and no real token sees it (causal rows;
    a mask that masks it out), so the real tokens' log-probs and gradients are those of the unpadded rows;
    ``score_index`` is re-addressed to the wider rows, and padded positions see only themselves (no empty softmax)."""
    from megatron.core import parallel_state

    tp = parallel_state.get_tensor_model_parallel_world_size()
    b, s = input_ids.shape
    if not gpt.config.sequence_parallel or s % tp == 0:
        return input_ids, score_index, attention_mask
    wide = s + tp - s % tp
    # token 0 is any valid id: its outputs are never read
    input_ids = torch.nn.functional.pad(input_ids, (0, wide - s), value=0)
    score_index = score_index // s * wide + score_index % s
    if attention_mask is not None:
        mask = torch.ones(b, 1, wide, wide, dtype=torch.bool, device=attention_mask.device)
        mask[..., :s, :s] = attention_mask
        pad = torch.arange(s, wide, device=mask.device)
        mask[..., pad, pad] = False
        attention_mask = mask
    return input_ids, score_index, attention_mask


def score_tokens(
    model,
    input_ids: torch.Tensor,
    score_index: torch.Tensor,
    targets: torch.Tensor,
    *,
    attention_mask: torch.Tensor | None = None,
    temperature: float = 1.0,
    with_entropy: bool = False,
    scored: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log softmax(logits / T)[targets] (and the entropy) predicted at chosen positions: fp32 tensors [n, w].

    input_ids [b, s]: what the model reads. score_index [n, w] int64: flat positions (row * s + column) whose
    outputs predict targets [n, w]. attention_mask: None for causal rows with positions 0..s-1, else megatron's bool
    [b, 1, s, s] (True = masked) of a layout where each token sees exactly its own earlier tokens (see
    ``megamu.model.spec.PortableAttention``; the local spec only). ``scored`` [n, w] bool: only these entries are
    computed (the output layer and the vocab-wide log-softmax run on them alone); the others are 0. A batch's frame
    is as wide as its longest response, so on the shorter ones this skips the padding's share of the vocab work.
    Under sequence parallelism rows are padded to a multiple of TP here (``_pad_for_sequence_parallelism``).
    """
    from megamu.model.build import unwrap
    from megamu.model.spec import PortableAttention

    gpt = unwrap(model)
    if attention_mask is not None and not isinstance(gpt.decoder.layers[0].self_attention.core_attention,
                                                     PortableAttention):
        raise ValueError("an attention mask (shared prompts) needs --transformer-impl local: other core attentions "
                         "would not derive positions from it")
    if score_index.shape != targets.shape:
        raise ValueError(f"score_index {tuple(score_index.shape)} and targets {tuple(targets.shape)} must match")
    input_ids, score_index, attention_mask = _pad_for_sequence_parallelism(gpt, input_ids, score_index,
                                                                           attention_mask)
    b, s = input_ids.shape
    # megatron wants position ids; our core attention derives positions itself (0..s-1, or from the mask)
    position_ids = torch.arange(s, device=input_ids.device).unsqueeze(0).expand(b, s)
    if scored is None:
        with _output_layer_only_at(gpt, score_index):
            logits = model(input_ids, position_ids, attention_mask)
        return token_logprobs(logits, targets, temperature, with_entropy)
    with _output_layer_only_at(gpt, score_index[scored][None]):
        logits = model(input_ids, position_ids, attention_mask)  # [1, k, V/TP]: the scored entries only
    logp, entropy = token_logprobs(logits[0], targets[scored], temperature, with_entropy)
    frame = lambda values: torch.zeros(targets.shape, dtype=values.dtype, device=values.device).masked_scatter(
        scored, values)
    return frame(logp), None if entropy is None else frame(entropy)


def forward_logprobs(
    model,
    input_ids: torch.Tensor,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs of input_ids[:, 1:] given their prefixes ([b, s-1]), right padding assumed (positions 0..s-1):
    ``score_tokens`` at every position but the last."""
    b, s = input_ids.shape
    rows = torch.arange(b, device=input_ids.device)[:, None] * s
    index = rows + torch.arange(s - 1, device=input_ids.device)
    return score_tokens(model, input_ids, index, input_ids[:, 1:], temperature=temperature, with_entropy=with_entropy)
