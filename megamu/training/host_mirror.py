"""Host copies of device tensors for the offload around each rollout, in buffers kept from one refresh to the next.

megatron-core's ``MegatronOptimizer.offload_to_cpu`` (optimizer/optimizer.py, 0.16.1) moves every optimiser tensor
with ``.cpu()``: a fresh pageable allocation per tensor and per refresh, which the CUDA driver copies through a staging
buffer, and which the host must fault in page by page. The paper's colocated GRPO baseline refreshes 1024 times with
~21 GiB of fp32 main parameters and Adam moments per rank. Here each tensor gets one host buffer (pinned on GPUs, so
the copy is a direct DMA) at the first offload, reused by every later one; the tensors keep their identity (their
``.data`` is swapped), so everything that refers to them stays valid.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from megamu.memory.memory_plan_phases import SLAB_BYTES, pack_slabs


class HostMirror:
    """``offload`` moves tensors' data into this mirror's host buffers; ``reload`` brings it back, bit for bit.

    The buffers are views into slabs of one power-of-two size (``pack_slabs``): torch's CachingHostAllocator rounds
    each pinned allocation up to a power of two (``ATen/core/CachingHostAllocator.h``), so one buffer per tensor
    would cost up to twice the state (a 1.09 GB fp32 embedding shard takes 2 GiB); a slab loses nothing to it."""

    def __init__(self, pin: bool, slab_bytes: int = SLAB_BYTES):
        self.pin = pin  # the device decision (megamu.runtime.device): pinned host memory needs CUDA
        self.slab_bytes = slab_bytes
        self._slabs: list[torch.Tensor] = []
        self._host: dict[int, torch.Tensor] = {}
        self._layout: tuple = ()  # (id, shape, dtype) of each tensor the buffers were packed for
        self._moved: list[tuple[torch.Tensor, torch.device]] = []

    def host_bytes(self) -> int:
        return sum(s.numel() for s in self._slabs)

    def _pack(self, tensors: list[torch.Tensor]) -> None:
        self._slabs, self._host = [], {}  # buffers of tensors no longer given (a checkpoint load replaced them) go
        sizes = [t.numel() * t.element_size() for t in tensors]
        size, places = pack_slabs(sizes, self.slab_bytes)
        self._slabs = [torch.empty(size, dtype=torch.uint8, pin_memory=self.pin)
                       for _ in range(1 + max((i for i, _ in places), default=-1))]
        for t, n, (i, off) in zip(tensors, sizes, places):
            self._host[id(t)] = self._slabs[i][off : off + n].view(t.dtype).view(t.shape)

    def _buffers(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """The host buffer of each tensor: packed anew when the tensors changed, else the same views."""
        layout = tuple((id(t), tuple(t.shape), t.dtype) for t in tensors)
        if layout != self._layout:  # the first offload, or the optimiser's tensors changed: pack anew
            self._pack(tensors)
            self._layout = layout
        return [self._host[id(t)] for t in tensors]

    def offload(self, tensors: Iterable[torch.Tensor]) -> None:
        if self._moved:
            raise RuntimeError("HostMirror.offload: the tensors are already offloaded")
        tensors = list(tensors)
        for t, h in zip(tensors, self._buffers(tensors)):
            h.copy_(t.data, non_blocking=self.pin)
            self._moved.append((t, t.device))
        if self.pin:
            torch.cuda.synchronize()  # the copies are asynchronous: the device memory is freed only after them
        for t, _ in self._moved:
            t.data = self._host[id(t)]

    def reload(self) -> None:
        for t, device in self._moved:
            back = torch.empty(t.shape, dtype=t.dtype, device=device)
            back.copy_(t.data, non_blocking=self.pin)
            t.data = back
        if self.pin:
            torch.cuda.synchronize()
        self._moved = []


def device_tensors(optimizers: Iterable[torch.optim.Optimizer]) -> list[torch.Tensor]:
    """What megatron's ``offload_to_cpu`` moves: the CUDA parameters (fp32 main params) and CUDA state tensors of
    each torch optimiser (torch's AdamW keeps its ``step`` on the host: it stays)."""
    out = []
    for opt in optimizers:
        out += [p for g in opt.param_groups for p in g["params"] if p.is_cuda]
        out += [v for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor) and v.is_cuda]
    return out
