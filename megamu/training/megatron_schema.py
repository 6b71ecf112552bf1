"""The entries Megatron-LM's ``load_checkpoint`` reads beside the tensors, as Megatron-LM writes them.

References are to NVIDIA/Megatron-LM ``megatron/training/checkpointing.py`` at d98e8a6 (the file megamu was checked
against): ``generate_state_dict`` (:1556-1635) writes ``args``, ``checkpoint_version`` 3.0, ``iteration``,
``opt_param_scheduler`` and ``rng_state``; ``load_checkpoint`` (:2452) reads the checkpoint's ``args`` for its TP/PP
sizes (:2559-2562) and ``check_checkpoint_args`` (:176-220: num_layers, hidden_size, num_attention_heads,
add_position_embedding, max_position_embeddings, make_vocab_size_divisible_by, tokenizer_type), takes
``consumed_train_samples`` from them (:2878), loads RNG only when ``args.no_save_rng`` is unset and TP/PP match
(:2572-2595, :3071), and loads the scheduler inside its optimizer block (:3000-3005).

What does not interoperate: megamu's Adam moments are stored under Megatron's non-distributed optimizer keys
(``optimizer.state.exp_avg.<param key>``) but without its ``param_groups`` nesting, and Megatron-LM's
``--use-distributed-optimizer`` uses another layout, so Megatron-LM resumes a megamu checkpoint with
``--no-load-optim`` (a fresh optimizer, and so a fresh LR scheduler; iteration, consumed samples and, for a GPU-written
checkpoint, RNG come from the checkpoint) or starts from its weights with ``--finetune``. docs/checkpoints.md.
"""

from __future__ import annotations

import argparse
import random

import numpy as np
import torch

from megamu.model import ModelArch
from megamu.model.config import padded_vocab_size
from megamu.runtime import parallel

CHECKPOINT_VERSION = 3.0  # checkpointing.py:1572
VOCAB_DIVISIBLE_BY = 128  # padded_vocab_size's default: Megatron-LM's --make-vocab-size-divisible-by


def megatron_model_args(arch: ModelArch) -> dict:
    """The model's shape as Megatron-LM's arguments spell it (``megatron/training/arguments.py``, the network-size
    group, and megatron-core's ``TransformerConfig``): what a Megatron-LM launch of this model passes. The checkpoint's
    ``args`` record it, and a launch script's model flags are checked against it (megamu.arguments.model)."""
    return dict(
        num_layers=arch.num_layers, hidden_size=arch.hidden_size, ffn_hidden_size=arch.ffn_hidden_size,
        num_attention_heads=arch.num_heads, num_query_groups=arch.num_kv_heads,
        group_query_attention=arch.num_kv_heads != arch.num_heads, kv_channels=arch.head_dim,
        max_position_embeddings=arch.max_position_embeddings, add_position_embedding=False,  # RoPE
        position_embedding_type="rope", rotary_base=arch.rope_theta, rotary_percent=1.0, normalization="RMSNorm",
        norm_epsilon=arch.norm_eps, swiglu=True, add_bias_linear=False, add_qkv_bias=arch.qkv_bias,
        qk_layernorm=arch.qk_norm, untie_embeddings_and_output_weights=not arch.tie_embeddings,
        vocab_size=arch.vocab_size, num_experts=arch.num_experts or None, moe_router_topk=arch.moe_top_k or None,
        moe_ffn_hidden_size=arch.moe_ffn_hidden_size or None, attention_dropout=0.0, hidden_dropout=0.0,
        make_vocab_size_divisible_by=VOCAB_DIVISIBLE_BY)


def megatron_args(arch: ModelArch, iteration: int, optimizer_cfg, *, samples_per_update: int, world: int,
                  hf_source_dir: str | None, bf16: bool) -> argparse.Namespace:
    """The ``args`` namespace Megatron-LM pickles into common.pt, with the fields its load path reads; the lr schedule
    is the run's (``optimizer_cfg``: lr_decay_style, min_lr, lr_decay_iters)."""
    tp = parallel.tp_size()
    cuda = parallel.device().is_cuda
    return argparse.Namespace(
        **megatron_model_args(arch),
        padded_vocab_size=padded_vocab_size(arch.vocab_size, tp, VOCAB_DIVISIBLE_BY),
        tokenizer_type="HuggingFaceTokenizer", tokenizer_model=hf_source_dir,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=1, virtual_pipeline_model_parallel_size=None,
        expert_model_parallel_size=parallel.ep_size(), expert_tensor_parallel_size=parallel.etp_size(),
        data_parallel_size=parallel.dp_size(), world_size=world,
        iteration=iteration, consumed_train_samples=iteration * samples_per_update, skipped_train_samples=0,
        consumed_valid_samples=0, train_iters=None,
        lr=optimizer_cfg.lr, min_lr=optimizer_cfg.min_lr, lr_decay_style=optimizer_cfg.lr_decay_style,
        lr_decay_iters=optimizer_cfg.lr_decay_iters,
        lr_warmup_iters=optimizer_cfg.lr_warmup_iters, weight_decay=optimizer_cfg.weight_decay,
        adam_beta1=optimizer_cfg.adam_beta1, adam_beta2=optimizer_cfg.adam_beta2, adam_eps=optimizer_cfg.adam_eps,
        clip_grad=optimizer_cfg.clip_grad, optimizer="adam", use_distributed_optimizer=False,
        bf16=bf16, fp16=False, params_dtype=torch.bfloat16 if bf16 else torch.float32,
        ckpt_format="torch_dist", use_dist_ckpt=True, data_parallel_random_init=False,
        # a CPU process has no CUDA RNG to save; Megatron-LM then skips the RNG (checkpointing.py:2572-2595, :3071)
        no_save_rng=not cuda, no_save_optim=False,
    )


def opt_param_scheduler(optimizer_cfg, iteration: int, *, samples_per_update: int, total_updates: int | None) -> dict:
    """megamu's LR schedule (linear warmup, then ``lr_decay_style`` down to ``min_lr`` over ``lr_decay_iters``, by
    default the run's length) as megatron-core's ``OptimizerParamScheduler.state_dict`` (optimizer_param_scheduler.py),
    counted in samples as Megatron-LM steps it (``increment`` = global batch)."""
    total = (total_updates or iteration) * samples_per_update
    decay = (optimizer_cfg.lr_decay_iters or total_updates or iteration) * samples_per_update
    return {
        "max_lr": optimizer_cfg.lr, "lr_warmup_steps": optimizer_cfg.lr_warmup_iters * samples_per_update,
        "num_steps": iteration * samples_per_update, "lr_decay_style": optimizer_cfg.lr_decay_style,
        "lr_decay_steps": decay, "min_lr": optimizer_cfg.min_lr, "start_wd": optimizer_cfg.weight_decay,
        "end_wd": optimizer_cfg.weight_decay, "wd_incr_style": "constant", "wd_incr_steps": total,
    }


def rng_state():
    """Megatron-LM's ``get_rng_state`` for torch_dist (:451-510), this rank's states; None on CPU (no CUDA state:
    ``no_save_rng`` is set instead)."""
    if not parallel.device().is_cuda:
        return None
    from megatron.core import tensor_parallel

    return rng_sharded_object({
        "random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
        "torch_rng_state": torch.get_rng_state(), "cuda_rng_state": torch.cuda.get_rng_state(),
        "rng_tracker_states": tensor_parallel.get_cuda_rng_tracker().get_states()})


def rng_sharded_object(state: dict):
    """``state`` as Megatron-LM stores it: a ShardedObject "rng_state" over (PP, TP) holding [state], one replica
    per data-parallel rank (data_parallel_random_init off)."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    return ShardedObject("rng_state", [state], (1, parallel.tp_size()), (0, parallel.tp_rank()),
                         replica_id=parallel.dp_rank())


def megatron_entries(arch: ModelArch, iteration: int, optimizer_cfg, *, plan: dict | None, world: int,
                     hf_source_dir: str | None, bf16: bool) -> dict:
    """What ``save_checkpoint`` adds to its sharded state dict for Megatron-LM: ``args``, ``opt_param_scheduler``
    and (GPU) ``rng_state``. ``plan``: the run's (megamu.config.plan.StagedPlan or AsyncPlan as a dict), for the samples
    per update."""
    plan = plan or {}
    samples = plan.get("prompts_per_update", 1) * plan.get("n_samples_per_prompt", 1)
    total = plan.get("train_iters") or (plan["num_stages"] * plan["mu"] if plan.get("num_stages") else None)
    entries = {
        "args": megatron_args(arch, iteration, optimizer_cfg, samples_per_update=samples, world=world,
                              hf_source_dir=hf_source_dir, bf16=bf16),
        "opt_param_scheduler": opt_param_scheduler(optimizer_cfg, iteration, samples_per_update=samples,
                                                   total_updates=total),
    }
    rng = rng_state()
    if rng is not None:
        entries["rng_state"] = rng
    return entries
