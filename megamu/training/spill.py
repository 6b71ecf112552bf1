"""The trainer's own tensors spilled out of memory and back (what they occupy is megamu.memory.trainer_memory).

Used around a rollout (``--offload-train``): the engine gets the memory the trainer's gradients, optimiser moments
(and on GPU parameters and fp32 main parameters) would otherwise keep. ``spill`` / ``unspill`` keep the tensor
objects (and every view of them) alive with an empty storage, so whoever holds a reference sees the same values,
bit for bit, after ``unspill``.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import torch


def _raw(t: torch.Tensor):
    """The tensor's bytes as a writable buffer, without a copy. Not through numpy: a tensor that has been seen by
    numpy gets a storage that can no longer be resized, i.e. freed in place."""
    return (ctypes.c_char * (t.numel() * t.element_size())).from_address(t.data_ptr())


def spill(tensors: list[torch.Tensor], path: str | Path) -> int:
    """Write the (contiguous, CPU) ``tensors`` to ``path`` in order and free their storage; returns the bytes freed.

    The tensors must own their whole storage (no other tensor's data in it), which holds for optimiser moments."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    freed = 0
    with open(path, "wb") as f:
        for t in tensors:
            if t.device.type != "cpu" or not t.is_contiguous() or t.storage_offset() or \
                    t.untyped_storage().nbytes() != t.numel() * t.element_size():
                raise ValueError(f"spill: tensor of shape {tuple(t.shape)} is not a CPU tensor owning its storage")
            if t.numel():
                f.write(_raw(t))
        f.flush()
        os.fsync(f.fileno())  # the only copy of these values until unspill
    for t in tensors:
        freed += t.untyped_storage().nbytes()
        t.untyped_storage().resize_(0)
    return freed


def unspill(tensors: list[torch.Tensor], path: str | Path) -> None:
    """Give the ``tensors`` spilled to ``path`` their storage and bytes back (same order as ``spill``); removes
    ``path``."""
    path = Path(path)
    with open(path, "rb") as f:
        for t in tensors:
            nbytes = t.numel() * t.element_size()
            t.untyped_storage().resize_(nbytes)
            if nbytes and f.readinto(_raw(t)) != nbytes:
                raise OSError(f"{path}: spill file is truncated; the optimiser state cannot be restored")
    path.unlink()
