"""The trainer's memory, measured: bytes its tensors hold on the training device, by kind (params, grads, fp32 main
params, Adam moments), views counted once. The policy measures it after each update and while a rollout runs (the
``trainer_mem_*_gib`` metrics); the memory plan (megamu.memory.memory_plan_phases) is the estimate before the run.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass

import torch

from megamu.memory.memory_plan_phases import GIB


@dataclass
class TrainerMemory:
    """Bytes of the trainer's tensors resident on the training device, by kind (views counted once)."""

    params: int = 0
    grads: int = 0
    main_params: int = 0
    moments: int = 0

    @property
    def total(self) -> int:
        return self.params + self.grads + self.main_params + self.moments

    def gib(self) -> float:
        return self.total / GIB

    def to_dict(self) -> dict[str, int]:
        return {**asdict(self), "total": self.total}


def storage_bytes(tensors: Iterable[torch.Tensor | None], device: torch.device, seen: set[int]) -> int:
    """Bytes of the distinct storages behind ``tensors`` that live on ``device``; ``seen`` (storage addresses)
    carries over between calls so a view into a buffer counted earlier (a parameter in megatron's flat buffer,
    ``main_grad``) is not counted again. An offloaded storage (resized to 0) counts 0."""
    total = 0
    for t in tensors:
        if t is None or t.device != device:
            continue
        storage = t.untyped_storage()
        if storage.nbytes() == 0 or storage.data_ptr() in seen:
            continue
        seen.add(storage.data_ptr())
        total += storage.nbytes()
    return total
