"""Tensor-parallel split and merge of canonical tensors: the one place that knows how each parameter is sharded.

Works for anything shaped like a parameter (weights, Adam's exp_avg / exp_avg_sq), keyed by the canonical name.
MoE experts are also split over expert-parallel ranks, whole experts each: megatron's SequentialMLP numbers them
locally (``local_experts.<j>``, j < E / EP on every rank), canonical names carry the global index. Each expert is
split over its own expert-TP group (``--expert-tensor-parallel-size``, megatron-core's ETP: the TP group unless
given), formed apart from the dense TP group (parallel_state.py:1205).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Collection, Iterator

import torch
import torch.distributed as dist

from megamu.model.config import ModelArch, padded_vocab_size

_VOCAB = ("embedding.word_embeddings.weight", "output_layer.weight")
_ROWS = ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias")  # column-parallel, whole KV groups
# MoE experts (mlp.experts.local_experts.<j>.linear_fc*) are sharded over the expert-TP group like a dense MLP
# (megatron's expert TP size defaults to the TP size, parallel_state.py:786; ``_tp_of`` picks the group)
_GLU = ("linear_fc1.weight",)  # column-parallel; each rank holds [gate_r; up_r]
_COLS = ("linear_proj.weight", "linear_fc2.weight")  # row-parallel: input dim split
_REPLICATED = ("layernorm.weight", "layer_norm_weight", "mlp.router.weight")  # router: every rank holds all of it


def _kind(name: str) -> str:
    for kind, suffixes in (("vocab", _VOCAB), ("rows", _ROWS), ("glu", _GLU), ("cols", _COLS), ("rep", _REPLICATED)):
        if name.endswith(suffixes):
            return kind
    raise KeyError(f"no tensor-parallel rule for tensor {name!r}")


def shard_tensor(name: str, full: torch.Tensor, arch: ModelArch, tp_rank: int, tp_size: int) -> torch.Tensor:
    """This rank's slice of the canonical (full, unpadded-vocab) tensor ``name``."""
    kind = _kind(name)
    if kind == "rep" or tp_size == 1 and kind != "vocab":
        return full
    if kind == "vocab":
        if full.shape[0] != arch.vocab_size:
            raise ValueError(f"{name}: expected {arch.vocab_size} vocab rows, got {tuple(full.shape)}")
        pad = padded_vocab_size(arch.vocab_size, tp_size) - arch.vocab_size
        if pad:  # padded rows are never sampled (log-probs mask them); zeros keep them inert
            full = torch.cat((full, full.new_zeros(pad, *full.shape[1:])))
        return full.chunk(tp_size, dim=0)[tp_rank]
    if kind == "rows":
        return full.chunk(tp_size, dim=0)[tp_rank]
    if kind == "cols":
        return full.chunk(tp_size, dim=1)[tp_rank]
    gate, up = full.chunk(2, dim=0)
    return torch.cat((gate.chunk(tp_size, dim=0)[tp_rank], up.chunk(tp_size, dim=0)[tp_rank]))


def _tp_of(name: str) -> tuple[int, int, object]:
    """(rank, size, group) of the tensor-parallel group ``name`` is split over: an expert's own expert-TP group
    (megatron-core's ETP, ``--expert-tensor-parallel-size``), else the dense TP group."""
    from megatron.core import parallel_state as ps

    if _LOCAL_EXPERT.search(name):
        return (ps.get_expert_tensor_parallel_rank(), ps.get_expert_tensor_parallel_world_size(),
                ps.get_expert_tensor_parallel_group())
    return (ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size(),
            ps.get_tensor_model_parallel_group())


def gather_tensor(name: str, local: torch.Tensor, arch: ModelArch) -> torch.Tensor:
    """The canonical full tensor from every TP rank's ``local`` slice (a collective over the TP group; an expert's:
    over its expert-TP group).

    At TP=1 (and for replicated tensors) the result is a view of ``local``, not a copy: clone before mutating it."""
    kind = _kind(name)
    local = local.detach()
    if kind == "rep":
        return local
    _, tp, group = _tp_of(name)
    if tp == 1:  # no copy: the layouts coincide, only vocab padding goes
        return local[: arch.vocab_size] if kind == "vocab" else local
    parts = [torch.empty_like(local) for _ in range(tp)]
    dist.all_gather(parts, local.contiguous(), group=group)
    if kind == "vocab":
        return torch.cat(parts)[: arch.vocab_size]
    if kind == "rows":
        return torch.cat(parts)
    if kind == "cols":
        return torch.cat(parts, dim=1)
    halves = [p.chunk(2, dim=0) for p in parts]
    return torch.cat([h[0] for h in halves] + [h[1] for h in halves])


_LOCAL_EXPERT = re.compile(r"\.local_experts\.(\d+)\.")


def _ep() -> tuple[int, int]:
    from megamu.runtime import parallel

    return parallel.ep_rank(), parallel.ep_size()


def global_expert_name(name: str, arch: ModelArch, ep_rank: int, ep_size: int) -> str:
    """The canonical name of expert-parallel rank ``ep_rank``'s local expert parameter ``name`` (others unchanged)."""
    m = _LOCAL_EXPERT.search(name)
    if m is None or ep_size == 1:
        return name
    expert = ep_rank * (arch.num_experts // ep_size) + int(m.group(1))
    return f"{name[: m.start()]}.local_experts.{expert}.{name[m.end():]}"


def _named_parameters(model) -> Iterator[tuple[str, torch.nn.Parameter]]:
    from megamu.model.build import unwrap
    from megamu.model.spec import canonical_param_name

    for name, p in unwrap(model).named_parameters():
        yield canonical_param_name(name), p


def full_state_dict(model, arch: ModelArch) -> Iterator[tuple[str, torch.Tensor]]:
    """(canonical name, full tensor) one at a time; every TP and EP rank must iterate (each step is a collective).
    At EP > 1 each expert parameter comes from every expert-parallel rank, gathered over the EP group."""
    _, ep = _ep()
    for name, p in _named_parameters(model):
        full = gather_tensor(name, p, arch)
        if ep == 1 or not _LOCAL_EXPERT.search(name):
            yield name, full
            continue
        from megatron.core import parallel_state

        parts = [torch.empty_like(full) for _ in range(ep)]
        dist.all_gather(parts, full.contiguous(), group=parallel_state.get_expert_model_parallel_group())
        for r, part in enumerate(parts):
            yield global_expert_name(name, arch, r, ep), part


@torch.no_grad()
def load_full_state_dict(
    model,
    arch: ModelArch,
    get_tensor: Callable[[str], torch.Tensor],
    names: Collection[str] | None = None,
) -> None:
    """Copy canonical tensors into the (TP-sharded) model; ``names`` (all available tensors) enables the unexpected
    check. Raises KeyError naming missing/unexpected tensors and the family, ValueError on shape mismatch."""
    ep_rank, ep = _ep()
    missing, loaded, elsewhere = [], set(), set()  # elsewhere: other expert-parallel ranks' experts
    for local_name, p in _named_parameters(model):
        name = global_expert_name(local_name, arch, ep_rank, ep)
        if ep > 1 and _LOCAL_EXPERT.search(local_name):
            elsewhere |= {global_expert_name(local_name, arch, r, ep) for r in range(ep)}
        try:
            full = get_tensor(name)
        except KeyError:
            missing.append(name)
            continue
        rank, size, _ = _tp_of(name)
        local = shard_tensor(name, full, arch, rank, size)
        if local.shape != p.shape:
            what = "expert-TP" if _LOCAL_EXPERT.search(name) else "TP"
            raise ValueError(f"{arch.family} tensor {name}: checkpoint gives local shape {tuple(local.shape)} at "
                             f"{what} rank {rank}/{size}, model has {tuple(p.shape)}")
        p.copy_(local)
        loaded.add(name)
    unexpected = sorted(set(names) - loaded - elsewhere) if names is not None else []
    if missing or unexpected:
        raise KeyError(f"{arch.family} model: missing tensors {missing}, unexpected tensors {unexpected}")
