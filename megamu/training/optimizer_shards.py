"""A DP-sharded optimiser state streamed to host memory in bounded chunks, and its inverse, for checkpoints.

megatron's DistributedOptimizer gives each data-parallel rank a contiguous range of every flattened parameter
(``_get_model_param_range_map(p)["param"]``). A checkpoint in megamu's TP-resharding layout needs every state of a
parameter whole (its TP-local shape), so the ranges are summed over the DP group. Doing that on the device for every
parameter at once (megamu's ``param_state`` before: one full fp32 tensor per state per parameter, all kept until the
write) costs the whole optimiser state again on the GPU, ~58 GiB per GPU for Qwen3-30B-A3B on 8 x H200.

Here one device buffer of at most ``chunk_elements`` fp32 values is reused for every chunk of every state: zeroed,
this rank's part copied in, reduced over the group to the rank that writes the parameter, copied there to its place
in a host tensor. Only that replica stages the state: megatron's torch_dist save keeps the main replica of each
shard alone (``is_main_replica``, ``dist_checkpointing/strategies/torch.py:374``, ``keep_only_main_replica`` True
by default, :601), and a parameter's main replica is data-parallel rank 0 (``replica_id=(0, 0, dp_rank)``,
megatron/core/utils.py:981; experts: their expert-data-parallel rank, transformer/moe/experts.py:302); the
optimiser state keeps its parameter's replica id (``make_sharded_optimizer_tensor``,
dist_checkpointing/optimizer.py:104). The other replicas send their ranges and keep no host copy: one host copy per
shard, not one per data-parallel rank. The device holds that buffer and nothing else; the host holds the assembled
states until the checkpoint writer has them (megatron's async
torch_dist save stages device tensors to host anyway, ``filesystem_async.py`` ``preload_tensors``; a host tensor is
not staged again).

The same bound on load: ``load_dp_range`` slices this rank's range out of the loaded host tensor before moving it.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.distributed as dist

# fp32 elements of the one device buffer a save reuses: 128 MiB, as megamu's gradient all-reduce buckets
SAVE_CHUNK_ELEMENTS = 2**25


def assemble_dp_sharded(numel: int, start: int, end: int, local: Mapping[str, torch.Tensor | None],
                        keys: tuple[str, ...], group, device: torch.device, *, writes: bool = True,
                        chunk_elements: int = SAVE_CHUNK_ELEMENTS) -> dict[str, torch.Tensor] | None:
    """{key: fp32 host tensor of ``numel`` values}: the sum over ``group`` of each rank's ``local[key]``, which holds
    elements [start, end) of the flattened state (an absent key or an empty range contributes zeros), on the ranks
    that ``writes`` (the checkpoint's main replica of this parameter); None on the others, which stage nothing.

    A collective: every rank of ``group`` calls it with the same ``numel``, ``keys`` and ``chunk_elements``.
    ``device``: where the reduction runs (the GPU under NCCL, the CPU under gloo). With one writer in the group each
    chunk is reduced to it alone (the others send and keep no copy); with none, nothing moves; with several (a
    caller whose replicas are not distinct over the group), each chunk is all-reduced and each writer stages it.
    The host tensors are pageable: pinned ones would stay in torch's CachingHostAllocator, rounded up to a power of
    two, after the save."""
    if chunk_elements <= 0:
        raise ValueError(f"chunk_elements must be > 0, got {chunk_elements}")
    if not 0 <= start <= end <= numel:
        raise ValueError(f"range [{start}, {end}) is not inside a parameter of {numel} elements")
    writers = _writers(writes, group, device)
    if not writers:
        return None
    dst = dist.get_global_rank(group, writers[0]) if group is not None else writers[0]
    host = {k: torch.empty(numel, dtype=torch.float32) for k in keys} if writes else {}
    buf = torch.empty(min(chunk_elements, max(numel, 1)), dtype=torch.float32, device=device)
    for k in keys:
        mine = local.get(k)
        flat = None if mine is None else mine.detach().reshape(-1)
        for lo in range(0, numel, chunk_elements):
            hi = min(lo + chunk_elements, numel)
            piece = buf[: hi - lo]
            piece.zero_()
            a, b = max(lo, start), min(hi, end)
            if flat is not None and a < b:
                piece[a - lo : b - lo].copy_(flat[a - start : b - start])
            if len(writers) == 1:
                dist.reduce(piece, dst=dst, group=group)
            else:
                dist.all_reduce(piece, group=group)
            if writes:
                host[k][lo:hi].copy_(piece)  # synchronous: the buffer is overwritten by the next chunk
    return host if writes else None


def _writers(writes: bool, group, device: torch.device) -> list[int]:
    """The group ranks whose ``writes`` is set (one small all-gather)."""
    size = dist.get_world_size(group)
    mine = torch.tensor([1 if writes else 0], dtype=torch.int32, device=device)
    flags = [torch.zeros_like(mine) for _ in range(size)]
    dist.all_gather(flags, mine, group=group)
    return [i for i, f in enumerate(flags) if int(f.item())]


def load_dp_range(full: torch.Tensor, start: int, end: int, like: torch.Tensor) -> torch.Tensor:
    """Elements [start, end) of the flattened ``full`` (a loaded host tensor), on ``like``'s device in fp32 and
    shaped as ``like``: only this rank's range crosses to the device."""
    return full.reshape(-1)[start:end].to(device=like.device, dtype=torch.float32).view_as(like)
