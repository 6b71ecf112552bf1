"""Test-only: the few ``torch.cuda`` calls megatron-core 0.16.1's alltoall MoE dispatcher makes, answered for a CPU
process, so that upstream's own dispatcher (not a copy) runs on gloo in a test worker. Installed in worker processes
only (never in megamu: production keeps EP on CUDA, see megamu/run_config.py).

What needs it, and why each answer is exact on CPU (every CPU op is synchronous, so a stream orders nothing):
- ``transformer/moe/token_dispatcher.py:445``: ``torch.cuda.Stream()`` in the dispatcher's constructor (the DtoH side
  stream); ``:871-898``: ``current_stream``, ``wait_stream``, ``torch.cuda.stream(...)``, ``record_event`` and
  ``event.synchronize`` around copying the split sizes to the host: no-ops here.
- ``tensor_parallel/mappings.py:442``: the uneven all-to-all's output is ``new_empty(..., device=
  torch.cuda.current_device())``; ``:141/:148/:181``: the TP/SP gather and reduce-scatter buffers likewise. Answered
  with ``"cpu"``, the tensors' real device here.
- ``transformer/moe/moe_utils.py:1093``: ``maybe_move_tensor_to_cpu`` turns the split sizes into numpy arrays only
  ``if tensor.is_cuda``; a CPU tensor stays a tensor and ``all_to_all_single`` refuses it ("incompatible function
  arguments", measured). The dispatcher's name for it is wrapped so a CPU tensor gets the conversion a CUDA one gets.
"""

from __future__ import annotations

import contextlib

import torch


class _Event:
    def synchronize(self) -> None:  # CPU work is already done when the call returns
        pass


class _Stream:
    def wait_stream(self, other: _Stream) -> None:
        pass

    def record_event(self) -> _Event:
        return _Event()

    def __eq__(self, other: object) -> bool:  # one stream: the dispatcher then takes its "same stream" branch
        return isinstance(other, _Stream)

    __hash__ = object.__hash__


_ONE = _Stream()


def install() -> None:
    """Patch this process's ``torch.cuda`` for the calls above (a CPU-only torch: CUDA is absent, nothing is lost)."""
    assert not torch.cuda.is_available(), "the shim is for CPU-only processes"
    torch.cuda.Stream = lambda *a, **k: _ONE
    torch.cuda.current_stream = lambda *a, **k: _ONE
    torch.cuda.stream = lambda s=None: contextlib.nullcontext()
    torch.cuda.current_device = lambda: "cpu"
    from megatron.core.transformer.moe import token_dispatcher

    upstream = token_dispatcher.maybe_move_tensor_to_cpu

    def to_host(tensor, as_numpy: bool = False, record_stream: bool = False):
        if torch.is_tensor(tensor) and not tensor.is_cuda:  # what upstream does to the CUDA tensor it expects
            return tensor.numpy() if as_numpy else tensor
        return upstream(tensor, as_numpy=as_numpy, record_stream=record_stream)

    token_dispatcher.maybe_move_tensor_to_cpu = to_host
