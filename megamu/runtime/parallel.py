"""Process groups: torch.distributed + megatron-core model parallelism, on CPU (gloo) or GPU (nccl).

Under torchrun the world comes from the launcher's env vars; a plain `python` process gets a world of one, so the same
code paths (vocab-parallel log-probs, gathers) run in unit tests, tools and the CPU demo.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

from megamu.errors import ConfigError
from megamu.runtime.device import CPU, Device
from megamu.runtime.net import free_port

_device: Device = CPU  # set by init_distributed: the device this process trains on


def init_distributed(
    tensor_model_parallel_size: int = 1, seed: int = 0, device: Device = CPU,
    distributed_timeout_minutes: float | None = None, expert_model_parallel_size: int = 1,
    expert_tensor_parallel_size: int | None = None,
) -> None:
    """Create the default process group and megatron's TP/DP groups (and expert-parallel groups of
    ``expert_model_parallel_size`` ranks, for MoE models, each expert split over ``expert_tensor_parallel_size``
    ranks: the TP size when None), then seed the RNGs. Safe to call twice.

    ``distributed_timeout_minutes`` (fractions allowed) bounds every
    collective of those groups; None keeps torch's default (10 minutes for NCCL). Waits longer than that, such as
    ranks 1..N during the rank-0 rollout or while rank 0 writes an HF export, go through ``wait_for_main_rank``
    instead."""
    device.import_megatron()
    from megatron.core import parallel_state, tensor_parallel

    global _device, _collective_timeout

    tp = int(tensor_model_parallel_size)
    if parallel_state.model_parallel_is_initialized():
        if parallel_state.get_tensor_model_parallel_world_size() != tp:
            raise RuntimeError(
                f"init_distributed: already initialised with tensor_model_parallel_size="
                f"{parallel_state.get_tensor_model_parallel_world_size()}, asked for {tp}"
            )
        return
    _device = device
    if not dist.is_initialized():
        device.bind(int(os.environ.get("LOCAL_RANK", "0")))
        backend = device.backend
        timeout = _timeout(distributed_timeout_minutes)
        # Ranks reach the rendezvous apart (imports from a shared filesystem, a loaded node), so it gets at least
        # RENDEZVOUS_TIMEOUT; the asked timeout then bounds the default group's collectives (set just below).
        rendezvous = {"timeout": max(timeout["timeout"], RENDEZVOUS_TIMEOUT)} if timeout else {}
        if "RANK" in os.environ:  # torchrun
            dist.init_process_group(backend, **rendezvous)
        else:  # plain python: a world of one on a free local port, without touching the env of child processes
            dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1,
                                    **rendezvous)
        _collective_timeout = timeout.get("timeout")
        if timeout:
            # torch 2.13 distributed_c10d.py:1616: sets the timeout of the group's gloo/NCCL backends after init
            # (tests/training/test_parallel.py checks that a plain barrier then times out at the short bound)
            dist.distributed_c10d._set_pg_timeout(timeout["timeout"])
    if _wait_group is None:
        _init_wait_group()
    world = dist.get_world_size()
    if tp < 1 or world % tp:
        raise ValueError(f"world size {world} is not divisible by --tensor-model-parallel-size {tp}")
    # megatron gives its TP/DP groups their own timeout (30 minutes unless told): the same one as the default group
    # megatron-core's expert groups: ETP x EP x expert-DP over the whole world, apart from the dense TP x DP ones
    # (parallel_state.py:786-805)
    ep, etp = int(expert_model_parallel_size), int(expert_tensor_parallel_size or tp)
    if ep < 1 or etp < 1 or world % (etp * ep):
        raise ValueError(f"world size {world} is not divisible by ETP x EP = {etp} x {ep}")
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, expert_model_parallel_size=ep,
                                             expert_tensor_parallel_size=etp,
                                             **_megatron_timeout(distributed_timeout_minutes))
    torch.manual_seed(seed)
    # megatron's default tracker reads the CUDA RNG; the inference tracker keeps plain torch RNG states on CPU.
    tensor_parallel.model_parallel_cuda_manual_seed(seed, inference_rng_tracker=not device.is_cuda)


def device() -> Device:
    """The device given to init_distributed (CPU before it)."""
    return _device


def _timeout(minutes: float | None) -> dict:
    if minutes is None:
        return {}
    if not minutes > 0:
        raise ConfigError("distributed_timeout_minutes", f"must be > 0, got {minutes}")
    return {"timeout": timedelta(minutes=minutes)}


def _megatron_timeout(minutes: float | None) -> dict:
    return {} if minutes is None else {"distributed_timeout_minutes": minutes}  # a float works (timedelta)


# How long the first rendezvous waits for every rank at least, whatever --distributed-timeout-minutes says.
RENDEZVOUS_TIMEOUT = timedelta(minutes=10)
# A rollout on rank 0 can take hours (262k samples per stage in the paper's setting); this only bounds a dead rank 0.
MAIN_RANK_WAIT_TIMEOUT = timedelta(days=2)
_wait_group: dist.ProcessGroup | None = None
_save_group: dist.ProcessGroup | None = None  # a checkpoint save's collectives and waits (save_group)
_collective_timeout: timedelta | None = None  # --distributed-timeout-minutes (None: torch's default)


def _init_wait_group() -> None:
    """Gloo groups over all ranks with timeouts of their own: their waits are on the CPU, so a long wait neither
    trips the NCCL watchdog nor keeps a spinning NCCL kernel on a GPU that the rollout engine uses. One for rank 0's
    long phases (wait_for_main_rank), one for checkpoint saves (save_group): a save's timeout is sized to each save,
    while the long phases keep theirs."""
    global _wait_group, _save_group
    if dist.get_world_size() > 1:
        _wait_group = dist.new_group(backend="gloo", timeout=MAIN_RANK_WAIT_TIMEOUT)
        _save_group = dist.new_group(backend="gloo", timeout=MAIN_RANK_WAIT_TIMEOUT)


# The slowest writer a save's timeout allows for: 50 MB/s per rank, a shared filesystem with 8 writers per node on
# one ~400 MB/s link (a 30B-A3B checkpoint, ~380 GB over 8 ranks, then gets 26 minutes), plus a fixed 10 minutes for
# rank 0's rename and retention.
SAVE_BYTES_PER_S = 50e6
SAVE_FIXED = timedelta(minutes=10)


def save_timeout(largest_rank_bytes: int) -> timedelta:
    """How long a rank may wait for the others during a save whose largest rank writes ``largest_rank_bytes``: never
    below the collective timeout the run asked for."""
    sized = SAVE_FIXED + timedelta(seconds=largest_rank_bytes / SAVE_BYTES_PER_S)
    return max(sized, _collective_timeout) if _collective_timeout else sized


def save_group(largest_rank_bytes: int) -> dist.ProcessGroup | None:
    """The CPU-side gloo group a checkpoint save runs its collectives and waits on, its timeout set for this save
    (``save_timeout``); None in a world of one. Every rank waits there for the slowest writer and for rank 0's
    rename and retention, which on the default group would meet the NCCL watchdog (torchtitan's CheckpointManager
    gives torch.distributed.checkpoint a gloo group of its own for the same reason)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    if _save_group is None:
        raise RuntimeError("save_group: the process group was not created by init_distributed")
    dist.distributed_c10d._set_pg_timeout(save_timeout(largest_rank_bytes), _save_group)
    return _save_group


def wait_for_main_rank() -> None:
    """Every rank blocks here until all have arrived (a barrier on the CPU-side gloo group): for the phases only
    rank 0 works in (the rollout), which may last far longer than ``distributed_timeout_minutes``."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        if _wait_group is None:
            raise RuntimeError("wait_for_main_rank: the process group was not created by init_distributed")
        dist.barrier(group=_wait_group)


def destroy_distributed() -> None:
    global _wait_group, _save_group
    from megatron.core import parallel_state

    _wait_group = _save_group = None

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def tp_rank() -> int:
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_rank()


def tp_size() -> int:
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_world_size()


def tp_group() -> dist.ProcessGroup:
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_group()


def dp_rank() -> int:
    from megatron.core import parallel_state

    return parallel_state.get_data_parallel_rank()


def dp_size() -> int:
    from megatron.core import parallel_state

    return parallel_state.get_data_parallel_world_size()


def dp_group() -> dist.ProcessGroup:
    from megatron.core import parallel_state

    return parallel_state.get_data_parallel_group()


def gathers_full_weights() -> bool:
    """Whether this rank takes part in gathering the full weights (exports, engine pushes): the first data-parallel
    replica's ranks, and at expert-parallel size > 1 also those holding the other experts, i.e. expert-data-parallel
    rank 0 (the data-parallel rank at EP = 1: the expert-data-parallel group is then the data-parallel group). With
    experts at their own TP the ETP x EP group may span dense replicas (TP 4 / ETP 1 x EP 8 on 8 GPUs: expert-DP 1),
    and then every rank takes part: the other replicas' ranks in the expert gathers, and in their own TP group's."""
    from megatron.core import parallel_state

    return parallel_state.get_expert_data_parallel_rank() == 0


def expert_dp_group() -> dist.ProcessGroup:
    """The ranks holding the same experts of an MoE model (the data-parallel group at expert-parallel size 1)."""
    from megatron.core import parallel_state

    return parallel_state.get_expert_data_parallel_group()


def ep_rank() -> int:
    from megatron.core import parallel_state

    return parallel_state.get_expert_model_parallel_rank()


def ep_size() -> int:
    from megatron.core import parallel_state

    return parallel_state.get_expert_model_parallel_world_size()


def etp_size() -> int:
    """megatron-core's expert-TP size: the ranks each expert is split over (the TP size unless given)."""
    from megatron.core import parallel_state

    return parallel_state.get_expert_tensor_parallel_world_size()


def ep_agreed_count(n: int, device: torch.device) -> int:
    """The largest ``n`` over this rank's expert-tensor-and-model-parallel group (ETP x EP ranks; ``n`` itself when
    that group lies inside the TP group, whose ranks share their data). Every MoE layer's forward and backward is a
    collective over that group (the alltoall dispatcher's all-to-all over EP and gather over ETP, the allgather
    dispatcher's gather over both: transformer/moe/token_dispatcher.py, ``tp_ep_group``), and with experts at their
    own TP it spans data-parallel replicas (TP 4 / ETP 1 x EP 8 on 8 GPUs: all of them), so its ranks must run the
    same number of micro-batches even when their data-parallel shares differ."""
    from megatron.core import parallel_state as ps

    group_size = ps.get_expert_tensor_and_model_parallel_world_size()
    tp = ps.get_tensor_model_parallel_world_size()
    if group_size == 1 or (tp % group_size == 0 and ps.get_expert_model_parallel_world_size() == 1):
        return n
    t = torch.tensor([n], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=ps.get_expert_tensor_and_model_parallel_group())
    return int(t.item())


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def is_main_rank() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def ranks_per_node() -> int:
    """Trainer ranks on one node: torchrun's LOCAL_WORLD_SIZE (the whole world without torchrun)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", world_size()))


def is_node_main() -> bool:
    """Local rank 0 of this node (torchrun's LOCAL_RANK): the rank that owns the node's SGLang servers."""
    return int(os.environ.get("LOCAL_RANK", "0")) == 0


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def broadcast_object(obj, *, wait: bool = False):
    """Rank 0's ``obj`` on every rank (itself in a world of one). ``wait``: over the CPU-side gloo group, for a value
    rank 0 may take long to produce (while it waits for an engine), so the wait is not bound by the collective
    timeout and no NCCL kernel spins meanwhile."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0, group=_wait_group if wait else None)
    return box[0]


def all_gather_object(obj, group: dist.ProcessGroup | None = None, *, wait: bool = False) -> list:
    """Every rank's ``obj`` (of ``group``, default all ranks), in rank order. ``wait``: over all ranks' CPU-side
    gloo group, as ``broadcast_object``'s (while the trainer is offloaded and servers start)."""
    if not dist.is_initialized():
        return [obj]
    if wait and group is None:
        group = _wait_group
    out: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out
