"""The checkpoint's optimiser state, assembled from DP ranges through one bounded buffer (2 gloo ranks).

megatron's DistributedOptimizer gives each DP rank a contiguous range of each flattened parameter
(megatron/core/optimizer/distrib_optimizer.py, ``_build_model_gbuf_param_range_map``: ranges of the bucket that
rank owns, so a parameter may be split unevenly, or lie wholly on one rank). Reference: the full tensor each rank's
range was cut from. The bound: every tensor an op creates while assembling, other than the returned host tensors and
views of the inputs, is counted by a TorchDispatchMode; none may exceed one chunk of fp32.
"""

from __future__ import annotations

import os

import pytest
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


# --- one host copy per shard (issue 50 item 4): only the replica that writes a parameter stages its state ---

WRITERS = {"rank 0": (True, False), "rank 1": (False, True), "none": (False, False), "both": (True, True)}


def _writer_worker(rank: int, store_path: str, out_path: str) -> None:
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, is_main_replica
    from megatron.core.dist_checkpointing.optimizer import make_sharded_optimizer_tensor

    from megamu.training.checkpoint import save_strategy

    dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank, world_size=2)
    numel, split = 23, 5
    full = _full(7, numel)
    start, end = (0, split) if rank == 0 else (split, numel)
    local = {k: v[start:end].clone() for k, v in full.items()}
    results = {}
    for name, flags in WRITERS.items():
        counter = AllocationCounter()
        with counter:
            host = assemble_dp_sharded(numel, start, end, local, KEYS, None, torch.device("cpu"), writes=flags[rank],
                                       chunk_elements=CHUNK)
        inputs = {t.untyped_storage().data_ptr() for t in local.values()}
        inputs |= {t.untyped_storage().data_ptr() for t in (host or {}).values()}
        results[name] = {"host": host, "largest": max((b for ptr, b in counter.seen if ptr not in inputs), default=0)}
    # a save as megamu's checkpoint makes it: each parameter's ShardedTensor has megatron's replica id (0, 0, dp
    # rank); the optimiser state is staged and added on its main replica alone, then loaded on both ranks
    shape = (numel,)
    params = {f"p{i}": _full(10 + i, numel)["main_param"] for i in range(2)}
    saved = {}
    for key, value in params.items():
        sh = ShardedTensor.from_rank_offsets(f"model.{key}", value, replica_id=(0, 0, rank))
        saved[key] = sh
        writes = is_main_replica(sh.replica_id)
        state = assemble_dp_sharded(numel, start, end, {k: v * (1 + int(key[1])) for k, v in local.items()}, KEYS,
                                    None, torch.device("cpu"), writes=writes, chunk_elements=CHUNK)
        assert (state is not None) == writes
        for k, v in (state or {}).items():
            saved[f"{k}.{key}"] = make_sharded_optimizer_tensor(sh, v, f"optimizer.state.{k}")
    os.makedirs(out_path + ".ckpt", exist_ok=True)
    dist.barrier()
    dist_checkpointing.save(saved, out_path + ".ckpt", sharded_strategy=save_strategy())
    templates = {}
    for key in params:
        sh = ShardedTensor.from_rank_offsets(f"model.{key}", torch.empty(shape), replica_id=(0, 0, rank))
        templates[key] = sh
        for k in KEYS:
            templates[f"{k}.{key}"] = make_sharded_optimizer_tensor(sh, torch.empty(shape), f"optimizer.state.{k}")
    loaded = dist_checkpointing.load(templates, out_path + ".ckpt")
    results["loaded"] = loaded
    torch.save(results, f"{out_path}.{rank}")
    dist.destroy_process_group()


@pytest.mark.slow  # a gloo world of 2 saving and loading through dist_checkpointing
def test_only_the_writing_replica_stages_and_the_saved_state_loads_back_equal(tmp_path):
    mp.spawn(_writer_worker, args=(str(tmp_path / "store"), str(tmp_path / "out")), nprocs=2, join=True)
    full = _full(7, 23)
    for rank in range(2):
        results = torch.load(tmp_path / f"out.{rank}")
        for name, flags in WRITERS.items():
            host = results[name]["host"]
            if flags[rank]:
                assert set(host) == set(KEYS) and all(torch.equal(host[k], full[k]) for k in KEYS), (name, rank)
            else:
                assert host is None, (name, rank)
            # besides a writer's host tensors, one fp32 chunk at most: a rank that does not write has no host copy
            assert results[name]["largest"] <= CHUNK * 4, (name, rank)
        for i in range(2):
            for k in KEYS:
                assert torch.equal(results["loaded"][f"{k}.p{i}"], full[k] * (1 + i)), (rank, i, k)
            assert torch.equal(results["loaded"][f"p{i}"], _full(10 + i, 23)["main_param"])


def test_megatron_writes_only_the_main_replica_and_gives_dp_rank_0_the_main_one():
    """The upstream facts the staging rests on (megatron-core 0.16.1): torch_dist keeps only main replicas by default
    (strategies/torch.py:374, :601), a TP-sharded parameter's replica id is (0, 0, dp rank) (utils.py:980-981) and an
    expert's (0, 0, expert-dp rank) (transformer/moe/experts.py:302), an optimiser state takes its parameter's
    (dist_checkpointing/optimizer.py:104), and coverage is validated over main replicas alone (validation.py:411)."""
    import inspect

    import megatron.core.utils as utils
    from megatron.core.dist_checkpointing import optimizer, validation
    from megatron.core.dist_checkpointing.strategies import torch as torch_strategy
    from megatron.core.transformer.moe import experts

    def line(module, n: int) -> str:
        return inspect.getsource(module).splitlines()[n - 1].strip()

    assert line(torch_strategy, 374) == "if is_main_replica(sh_base.replica_id) or not keep_only_main_replica:"
    assert line(torch_strategy, 601) == "keep_only_main_replica: bool = True,"
    assert line(utils, 980) == "if replica_id is None:" and line(utils, 981) == "replica_id = (0, 0, dp_replica_id)"
    assert line(experts, 302) == "replica_id = (0, 0, dp_rank)"
    assert line(optimizer, 104) == "sh_ten = replace("
    assert "main replicas of the shards" in line(validation, 411)
