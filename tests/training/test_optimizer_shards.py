"""The checkpoint's optimiser state, assembled from DP ranges through one bounded buffer (2 gloo ranks).

megatron's DistributedOptimizer gives each DP rank a contiguous range of each flattened parameter
(megatron/core/optimizer/distrib_optimizer.py, ``_build_model_gbuf_param_range_map``: ranges of the bucket that
rank owns, so a parameter may be split unevenly, or lie wholly on one rank). Reference: the full tensor each rank's
range was cut from. The bound: every tensor an op creates while assembling, other than the returned host tensors and
views of the inputs, is counted by a TorchDispatchMode; none may exceed one chunk of fp32.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from megamu.training.optimizer_shards import assemble_dp_sharded, load_dp_range

KEYS = ("exp_avg", "exp_avg_sq", "main_param")
CHUNK = 7  # elements: smaller than every parameter below, and dividing none of them


class AllocationCounter(TorchDispatchMode):
    """(storage pointer, bytes) of every tensor any op returns."""

    def __init__(self):
        super().__init__()
        self.seen: list[tuple[int, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                st = t.untyped_storage()
                self.seen.append((st.data_ptr(), st.nbytes()))
        return out


def _full(seed: int, numel: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(numel, generator=g, dtype=torch.float32) for k in KEYS}


# (numel, the split point between rank 0's and rank 1's ranges): even, uneven, all on rank 0, all on rank 1
CASES = [(40, 20), (23, 5), (16, 16), (30, 0)]


def _worker(rank: int, store_path: str, out_path: str) -> None:
    store = dist.FileStore(store_path, 2)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    results = []
    for i, (numel, split) in enumerate(CASES):
        full = _full(i, numel)
        start, end = (0, split) if rank == 0 else (split, numel)
        local = {k: v[start:end].clone() for k, v in full.items()}
        if i == 1:
            local.pop("main_param")  # a state a rank lacks (moments before the first update) contributes zeros
        inputs = {t.untyped_storage().data_ptr() for t in local.values()}
        counter = AllocationCounter()
        with counter:
            host = assemble_dp_sharded(numel, start, end, local, KEYS, None, torch.device("cpu"),
                                       chunk_elements=CHUNK)
        mine = {t.untyped_storage().data_ptr() for t in host.values()} | inputs
        largest = max((b for ptr, b in counter.seen if ptr not in mine), default=0)
        # the inverse: this rank's range back from the assembled state
        back = {k: load_dp_range(host[k], start, end, local[k]) for k in local}
        results.append({"host": host, "largest": largest, "back": back, "local": local})
    torch.save(results, f"{out_path}.{rank}")
    dist.destroy_process_group()


def test_each_state_is_the_sum_of_the_ranges_through_one_chunk_and_loads_back(tmp_path):
    mp.spawn(_worker, args=(str(tmp_path / "store"), str(tmp_path / "out")), nprocs=2, join=True)
    for rank in range(2):
        results = torch.load(tmp_path / f"out.{rank}")
        for i, ((numel, _), r) in enumerate(zip(CASES, results)):
            full = _full(i, numel)
            for k in KEYS:
                want = full[k].clone()
                if i == 1 and k == "main_param":
                    want.zero_()  # neither rank had it
                assert torch.equal(r["host"][k], want), (i, k, rank)  # a sum with zeros: exact
                assert r["host"][k].device.type == "cpu"
            assert 0 < r["largest"] <= CHUNK * 4, (i, r["largest"])  # one fp32 chunk, not a parameter
            for k, v in r["back"].items():
                assert torch.equal(v, r["local"][k]), (i, k, rank)


def test_bad_ranges_and_chunks_are_refused():
    import pytest

    with pytest.raises(ValueError, match="range"):
        assemble_dp_sharded(10, 4, 12, {}, KEYS, None, torch.device("cpu"))
    with pytest.raises(ValueError, match="chunk_elements"):
        assemble_dp_sharded(10, 0, 10, {}, KEYS, None, torch.device("cpu"), chunk_elements=0)
