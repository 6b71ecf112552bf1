"""The optimiser's offload around each rollout: one host buffer per tensor, reused by every refresh, bitwise back.

megatron-core 0.16.1's ``MegatronOptimizer.offload_to_cpu`` (megatron/core/optimizer/optimizer.py:344-362) moves each
tensor with ``p.data = p.data.cpu()`` / ``state_dict[k] = v.cpu()``: a new pageable host tensor per tensor per
refresh. The GPU path (MegatronDistributedAdam) now offloads through HostMirror(pin=True); this checks the same
logic on CPU tensors (pinning needs CUDA)."""

import torch

from megamu.training.host_mirror import HostMirror, device_tensors


def _state(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(64, 32, generator=g), torch.randn(17, generator=g), torch.randn(3, 5, generator=g).double()]


def test_offload_reload_is_bitwise_and_keeps_the_tensors():
    tensors = _state(0)
    want = [t.clone() for t in tensors]
    ids, ptrs = [id(t) for t in tensors], [t.data_ptr() for t in tensors]
    mirror = HostMirror(pin=False)
    mirror.offload(tensors)
    assert all(t.data_ptr() != p for t, p in zip(tensors, ptrs))  # the data left its storage
    mirror.reload()
    assert [id(t) for t in tensors] == ids  # the same objects: references to them stay valid
    assert all(torch.equal(t, w) and t.dtype == w.dtype for t, w in zip(tensors, want))


def test_host_buffers_are_allocated_once_and_reused_by_every_refresh():
    tensors = _state(1)
    mirror = HostMirror(pin=False)
    mirror.offload(tensors)
    first = [t.data_ptr() for t in tensors]  # offloaded: the tensors live in the mirror's buffers
    size = mirror.host_bytes()
    mirror.reload()
    for step in range(3):  # an update changes the values between refreshes; the buffers stay
        for t in tensors:
            t.add_(step + 1)
        want = [t.clone() for t in tensors]
        mirror.offload(tensors)
        assert [t.data_ptr() for t in tensors] == first and mirror.host_bytes() == size
        mirror.reload()
        assert all(torch.equal(t, w) for t, w in zip(tensors, want))


def test_only_device_tensors_move():
    """torch's AdamW (megatron's fallback without TE/apex) keeps a per-parameter ``step`` on the host: not moved."""
    p = torch.nn.Parameter(torch.randn(4))
    opt = torch.optim.AdamW([p])
    p.grad = torch.ones(4)
    opt.step()
    assert device_tensors([opt]) == []  # on a CPU machine nothing is on a CUDA device


def test_buffers_of_tensors_no_longer_given_are_dropped():
    """A checkpoint load may replace optimiser tensors: their old host buffers must not stay pinned for the run."""
    a, b = torch.randn(300), torch.randn(300)  # 1200 bytes each: one 2048-byte slab holds one of them
    mirror = HostMirror(pin=False, slab_bytes=2048)
    mirror.offload([a, b])
    mirror.reload()
    assert mirror.host_bytes() == 2 * 2048
    mirror.offload([a])
    mirror.reload()
    assert mirror.host_bytes() == 2048


def test_slabs_hold_many_tensors_at_aligned_offsets_and_lose_no_rounding():
    """torch's CachingHostAllocator rounds every pinned allocation up to a power of two (ATen/core/
    CachingHostAllocator.h, ``PowerOf2Ceil`` in ``allocate``): a buffer per tensor of 1.09 GB would take 2 GiB.
    Slabs of a power-of-two size hold the tensors (first-fit decreasing); by hand for small sizes."""
    from megamu.memory.memory_plan_phases import SLAB_ALIGN, pack_slabs

    tensors = [torch.randn(100), torch.randn(10).double(), torch.randn(200), torch.randn(3, 7)]  # 400, 80, 800, 84 B
    want = [t.clone() for t in tensors]
    mirror = HostMirror(pin=False, slab_bytes=1024)
    mirror.offload(tensors)
    # first-fit decreasing, 512-byte aligned: 800 -> slab 0 at 0; 400 -> slab 1 at 0; 84 -> slab 1 at 512; 80 ->
    # slab 0 has 1024 - 1024 = 0 left (800 rounds up to 1024), slab 1 has 0 left (512 + 512): slab 2 at 0
    assert pack_slabs([400, 80, 800, 84], 1024) == (1024, [(1, 0), (2, 0), (0, 0), (1, 512)])
    assert mirror.host_bytes() == 3 * 1024
    assert all((t.data_ptr() - t.untyped_storage().data_ptr()) % SLAB_ALIGN == 0 for t in tensors)
    mirror.reload()
    assert all(torch.equal(t, w) and t.dtype == w.dtype for t, w in zip(tensors, want))
    # a tensor larger than the slab size: the slab grows to its power of two, and others still share it
    assert pack_slabs([3000, 500], 1024) == (4096, [(0, 0), (0, 3072)])
