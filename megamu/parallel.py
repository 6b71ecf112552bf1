"""Process groups: torch.distributed + megatron-core model parallelism, on CPU (gloo) or GPU (nccl).

Under torchrun the world comes from the launcher's env vars; a plain `python` process gets a world of one, so the same
code paths (vocab-parallel log-probs, gathers) run in unit tests, tools and the CPU demo.
"""

from __future__ import annotations

import os
import socket

import torch
import torch.distributed as dist

from megamu.device import CPU, Device

_device: Device = CPU  # set by init_distributed: the device this process trains on


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(tensor_model_parallel_size: int = 1, seed: int = 0, device: Device = CPU) -> None:
    """Create the default process group and megatron's TP/DP groups, then seed the RNGs. Safe to call twice."""
    from megatron.core import parallel_state, tensor_parallel

    global _device

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
        if "RANK" in os.environ:  # torchrun
            dist.init_process_group(backend)
        else:  # plain python: a world of one on a free local port, without touching the env of child processes
            dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    world = dist.get_world_size()
    if tp < 1 or world % tp:
        raise ValueError(f"world size {world} is not divisible by --tensor-model-parallel-size {tp}")
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    torch.manual_seed(seed)
    # megatron's default tracker reads the CUDA RNG; the inference tracker keeps plain torch RNG states on CPU.
    tensor_parallel.model_parallel_cuda_manual_seed(seed, inference_rng_tracker=not device.is_cuda)


def device() -> Device:
    """The device given to init_distributed (CPU before it)."""
    return _device


def destroy_distributed() -> None:
    from megatron.core import parallel_state

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


def is_main_rank() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()
