"""The optimiser's offload around each colocated refresh: megatron-core's ``offload_to_cpu`` (a fresh host tensor per
tensor per refresh, ``.cpu()``) against megamu's HostMirror (one host buffer per tensor, reused), on a CPU stand-in.

  python -m bench.offload_copy [--mib 512] [--tensors 64] [--cycles 5]

The "device" tensors are CPU tensors here, so this measures what the two ways differ in on the host side: a fresh
allocation faults in every page of the copy on each refresh; a reused buffer is already mapped. On a GPU the mirror's
buffers are also pinned, so the copy is a direct DMA instead of going through the driver's staging buffer; that part
needs a GPU to measure (tools/gpu_check.py). Best of --cycles offload+reload round trips for each; ratio > 1 means
the mirror is faster.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from megamu.training.host_mirror import HostMirror


def fresh_copies(tensors: list[torch.Tensor]) -> None:
    """megatron's offload_to_cpu then restore_from_cpu, with the host copy a new tensor each time."""
    for t in tensors:
        t.data = t.data.clone()  # stands in for .cpu(): a new host allocation the copy faults in
    for t in tensors:
        t.data = t.data.clone()  # stands in for .cuda()


def run(mib: int, n: int, cycles: int) -> dict:
    torch.manual_seed(0)
    per = mib * 2**20 // 4 // n
    tensors = [torch.randn(per) for _ in range(n)]
    mirror = HostMirror(pin=False)

    def mirrored() -> None:
        mirror.offload(tensors)
        mirror.reload()

    best = {}
    for name, fn in (("fresh", lambda: fresh_copies(tensors)), ("mirror", mirrored)):
        fn()  # the mirror allocates its buffers here, once
        times = []
        for _ in range(cycles):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        best[name] = min(times)
    gib = mib / 1024
    return {"mib": mib, "tensors": n, "fresh_s": best["fresh"], "mirror_s": best["mirror"],
            "fresh_gib_per_s": 2 * gib / best["fresh"], "mirror_gib_per_s": 2 * gib / best["mirror"],
            "ratio": best["fresh"] / best["mirror"]}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mib", type=int, default=512)
    p.add_argument("--tensors", type=int, default=64)
    p.add_argument("--cycles", type=int, default=5)
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    print(json.dumps(run(a.mib, a.tensors, a.cycles), indent=1))


if __name__ == "__main__":
    main()
