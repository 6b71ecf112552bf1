"""Build a megatron-core GPTModel for a ModelArch (call megamu.runtime.parallel.init_distributed first)."""

from __future__ import annotations

import torch

from megamu.model.config import ModelArch, padded_vocab_size, transformer_config
from megamu.model.moe_settings import MoeSettings
from megamu.model.spec import decoder_spec, finalize, position_embedding_kwargs
from megamu.runtime.device import CPU, Device


def build_model(
    arch: ModelArch,
    *,
    device: Device = CPU,
    transformer_impl: str | None = None,
    params_dtype: torch.dtype = torch.float32,
    bf16: bool = False,
    perform_initialization: bool = True,
    recompute_granularity: str | None = None,
    load_balancing: tuple[str, float] = ("none", 0.0),
    sequence_parallel: bool = False,
    moe: MoeSettings | None = None,
):
    """A GPTModel (pre/post process, vocab-parallel logits [b, s, V_padded/TP]), randomly initialised unless
    perform_initialization=False (weights left uninitialised, about to be loaded: much faster for big models).
    ``recompute_granularity``: "full" / "selective" activation recomputation, see ``recompute_fields``.
    ``load_balancing``: an MoE router's (megatron's load-balancing type, aux-loss coefficient), see
    ``moe_config_fields``.
    ``sequence_parallel``: megatron-core's sequence parallelism (TP > 1; CUDA, or a CPU test process with
    tests/cpu_cuda_shim.py: megamu.config.run_config refuses it on CPU runs).
    ``moe``: the launch's Megatron-LM MoE settings (megamu.model.moe_settings; the device's where it lacks them).
    ``transformer_impl`` defaults to the device's (see megamu.runtime.device)."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel

    if not parallel_state.model_parallel_is_initialized():
        raise RuntimeError("build_model: call megamu.runtime.parallel.init_distributed(...) first")
    tp = parallel_state.get_tensor_model_parallel_world_size()
    transformer_impl = transformer_impl or device.transformer_impl
    config = transformer_config(arch, tp=tp, ep=parallel_state.get_expert_model_parallel_world_size(),
                                etp=parallel_state.get_expert_tensor_parallel_world_size(), params_dtype=params_dtype,
                                bf16=bf16, transformer_impl=transformer_impl,
                                perform_initialization=perform_initialization,
                                recompute_granularity=recompute_granularity, load_balancing=load_balancing,
                                use_cpu_initialization=not device.is_cuda, sequence_parallel=sequence_parallel,
                                moe=moe)
    model = GPTModel(
        config=config,
        transformer_layer_spec=decoder_spec(arch, transformer_impl),
        vocab_size=padded_vocab_size(arch.vocab_size, tp),
        max_sequence_length=arch.max_position_embeddings,
        pre_process=True,
        post_process=True,
        parallel_output=True,
        share_embeddings_and_output_weights=arch.tie_embeddings,
        **position_embedding_kwargs(arch, transformer_impl),
    )
    finalize(model, arch, transformer_impl)
    if device.is_cuda:  # megatron allocates its weights there already, but torch norms (local spec) not
        model.cuda(torch.cuda.current_device())
    _mask_padded_vocab(model, arch, parallel_state.get_tensor_model_parallel_rank(), tp)
    if bf16:
        from megatron.core.transformer.module import Float16Module

        # bf16 weights and activations, fp32 logits out; the fp32 master weights live in the GPU optimizer
        model = Float16Module(config, model)
    return model


def _mask_padded_vocab(model, arch: ModelArch, tp_rank: int, tp: int) -> None:
    """Give padded vocab entries -inf logits, so no log-softmax over the model's output ever puts mass on them."""
    local = padded_vocab_size(arch.vocab_size, tp) // tp
    start = tp_rank * local
    if start + local <= arch.vocab_size:
        return
    pad = torch.arange(start, start + local) >= arch.vocab_size

    def hook(module, args, output):
        logits, bias = output
        return logits.masked_fill(pad.to(logits.device), float("-inf")), bias

    model.output_layer.register_forward_hook(hook)


def unwrap(model):
    """The GPTModel inside Float16Module / DDP wrappers."""
    while hasattr(model, "module"):
        model = model.module
    return model


def allreduce_tp_partial_grads(model) -> None:
    """Sum over the TP group the gradients of replicated parameters that each rank only sees part of.

    q/k norms are shared by all heads but each rank normalises only its own heads, so each holds a partial gradient.
    Under sequence parallelism every parameter megatron marks ``sequence_parallel`` (the norms, megamu.model.spec.
    RMSNorm; MoE routers, transformer/moe/router.py:74) sees only this rank's tokens: partial too. The same selection
    as megatron's finalize_model_grads on the GPU path (distributed/finalize_model_grads.py:354, by the mark and by
    the q/k names; each parameter summed once); call it on CPU after backward, before the data-parallel all-reduce.
    """
    from megatron.core import parallel_state

    if parallel_state.get_tensor_model_parallel_world_size() == 1:
        return
    group = parallel_state.get_tensor_model_parallel_group()
    for name, p in unwrap(model).named_parameters():
        partial = getattr(p, "sequence_parallel", False) or "q_layernorm" in name or "k_layernorm" in name
        if p.grad is not None and partial:
            torch.distributed.all_reduce(p.grad, group=group)
