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


class HostMirror:
    """``offload`` moves tensors' data into this mirror's host buffers; ``reload`` brings it back, bit for bit."""

    def __init__(self, pin: bool):
        self.pin = pin  # the device decision (megamu.device): pinned host memory needs CUDA
        self._host: dict[int, torch.Tensor] = {}
        self._moved: list[tuple[torch.Tensor, torch.device]] = []

    def host_bytes(self) -> int:
        return sum(h.numel() * h.element_size() for h in self._host.values())

    def offload(self, tensors: Iterable[torch.Tensor]) -> None:
        if self._moved:
            raise RuntimeError("HostMirror.offload: the tensors are already offloaded")
        old, self._host = self._host, {}  # buffers of tensors no longer given (a checkpoint load replaced them) go
        for t in tensors:
            h = old.get(id(t))
            if h is None or h.shape != t.shape or h.dtype != t.dtype:
                h = torch.empty(t.shape, dtype=t.dtype, pin_memory=self.pin)
            self._host[id(t)] = h
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
