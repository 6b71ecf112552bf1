"""Push buckets are allocated with expandable segments off, so the servers open them with a plain CUDA IPC handle.

torch's caching allocator exports a block of an expandable segment as a POSIX file descriptor that the receiving
process takes with pidfd_getfd (needs ptrace rights over the sender; refused by most container runtimes), and lets a
process turn expandable segments off for the allocations it means to share and back on after
(pytorch c10/cuda/CUDACachingAllocator.cpp, Note [Expandable Segments]: "it is possible to temporarily disable
(expandable_segments:False) the behavior for allocator tensors that need to be used cross-process";
``torch.cuda.memory._set_allocator_settings``). The trainer keeps them for everything else (examples/common.sh)."""

import contextlib

import pytest
import torch

from megamu.engines.sglang import tensor_sync
from megamu.runtime import device


@pytest.fixture
def settings(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda.memory, "_set_allocator_settings", calls.append)
    return calls


@pytest.mark.parametrize("var", ["PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"])
def test_shareable_allocations_turn_expandable_segments_off_and_back_on(monkeypatch, settings, var):
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    monkeypatch.setenv(var, "max_split_size_mb:64,expandable_segments:True")
    with device.ipc_shareable_allocations(on_cuda=True):
        settings.append("allocate")
    assert settings == ["expandable_segments:False", "allocate", "expandable_segments:True"]
    settings.clear()
    with pytest.raises(RuntimeError), device.ipc_shareable_allocations(on_cuda=True):
        raise RuntimeError("a failed allocation still restores the setting")
    assert settings == ["expandable_segments:False", "expandable_segments:True"]


def test_nothing_changes_without_expandable_segments_or_on_cpu(monkeypatch, settings):
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    with device.ipc_shareable_allocations(on_cuda=False):
        pass
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:False")
    with device.ipc_shareable_allocations(on_cuda=True):
        pass
    assert settings == []


def test_the_flat_bucket_is_allocated_inside_the_shareable_scope(monkeypatch):
    events = []

    @contextlib.contextmanager
    def scope(on_cuda):
        events.append(("enter", on_cuda))
        yield
        events.append("exit")

    real = tensor_sync.flatten
    monkeypatch.setattr(tensor_sync, "ipc_shareable_allocations", scope)
    monkeypatch.setattr(tensor_sync, "flatten", lambda ts: events.append("flatten") or real(ts))
    payload, flat = tensor_sync.serialize_bucket([("a", torch.ones(3)), ("b", torch.zeros(2, dtype=torch.float32))])
    assert events == [("enter", False), "flatten", "exit"]
    assert flat.numel() == 5 * 4 and payload
