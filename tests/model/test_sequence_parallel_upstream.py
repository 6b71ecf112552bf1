"""Why ``--sequence-parallel`` is still refused (megamu/arguments/megatron.py), pinned to megatron-core's source as
installed: if a newer megatron-core drops these lines, this fails and the refusal should be revisited.

Measured on this machine (torch 2.13 CPU, gloo, 2 ranks): ``all_gather_into_tensor``, ``reduce_scatter_tensor``
and uneven ``all_to_all_single`` all run on gloo, so the collectives SP needs are not what stops it. What does:
- ``transformer/torch_norm.py:32``: the local spec's norm (``WrappedTorchNorm``, the only norm without TE or apex)
  asserts ``not config.sequence_parallel``: a CPU model cannot be built with SP at all;
- ``tensor_parallel/mappings.py:141`` and ``:181``: SP's gather before and reduce-scatter after each TP block
  allocate on ``torch.cuda.current_device()``, which a CPU-only torch refuses ("Torch not compiled with CUDA").
"""

from pathlib import Path

import pytest


def _lines(module: str) -> list[str]:
    import importlib

    return Path(importlib.import_module(module).__file__).read_text().splitlines()


def test_the_local_specs_norm_refuses_sequence_parallelism():
    line = _lines("megatron.core.transformer.torch_norm")[31]  # line 32
    assert "assert not config.sequence_parallel" in line, line


@pytest.mark.parametrize("lineno,function", [(141, "_gather_along_first_dim"),
                                             (181, "_reduce_scatter_along_first_dim")])
def test_sp_mappings_allocate_on_the_cuda_device(lineno, function):
    lines = _lines("megatron.core.tensor_parallel.mappings")
    assert "device=torch.cuda.current_device()" in lines[lineno - 1], lines[lineno - 1]
    enclosing = next(line for line in reversed(lines[:lineno]) if line.startswith("def "))
    assert enclosing.startswith(f"def {function}("), enclosing
