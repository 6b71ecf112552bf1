"""How much memory a GPU has for the memory plan (``--gpu-memory-gib``), and what each process takes first.

The plan's rows share the card's memory as nvidia-smi reports it; each process's CUDA context and NCCL buffers are a
row of their own (``CUDA_CONTEXT_GIB``), so the ceiling is the card and nothing is counted twice.
"""

from __future__ import annotations

from megamu.errors import ConfigError

# CUDA context + NCCL communicators of one process on one GPU, a row of each process in the plan. the project's
# GPU-path notes ("Memory of the paper's 7B run") put it at ~2 GiB per trainer rank; SGLang processes are given the
# same (their NCCL groups, cuBLAS workspaces). Not measured on a multi-GPU node: gpu_check reports the context of
# its one process (no NCCL), the rest is an estimate.
CUDA_CONTEXT_GIB = 2.0
# A card's memory as nvidia-smi reports it, all of which the plan's rows share (each process's context above is a
# row): an H200 shows 143771 MiB, an H100 80GB HBM3 81559 MiB (read on lent machines: the device notes' KINDS.md,
# 2026-10-27 and 2026-11-13). The vendor's "141 GB" / "80 GB" are decimal and include what the driver reserves.
DEVICE_MIB = {"h200": 143771, "h100": 81559}
H200_GIB = DEVICE_MIB["h200"] / 1024  # 140.4: the default of --gpu-memory-gib
H100_GIB = DEVICE_MIB["h100"] / 1024  # 79.6


def device_label(gib: float) -> str:
    """``gib`` GiB, with the card it is (by nvidia-smi's MiB) when it is one the plan knows."""
    name = next((n.upper() for n, mib in DEVICE_MIB.items() if abs(gib * 1024 - mib) < 1), None)
    return f"{gib:.1f} GiB" + (f" ({name}: {DEVICE_MIB[name.lower()]} MiB in nvidia-smi)" if name else "")


def parse_gpu_memory(value: str) -> float:
    """``--gpu-memory-gib``'s value: GiB, or a card the plan knows by name (h200, h100)."""
    name = value.strip().lower()
    if name in DEVICE_MIB:
        return DEVICE_MIB[name] / 1024
    try:
        gib = float(value)
    except ValueError:
        raise ConfigError("gpu_memory_gib", f"{value!r}: expected GiB (e.g. 79.6) or one of {tuple(DEVICE_MIB)}") \
            from None
    if not gib > 0:
        raise ConfigError("gpu_memory_gib", f"must be a positive number of GiB, got {value!r}")
    return gib
