"""The upstream facts behind megamu's save group (issue 50), pinned to the installed source: if a newer megatron-core
or torch moves one, this fails and megamu.training.checkpoint's save path is to be revisited.

- megatron-core 0.16.1 ``dist_checkpointing/strategies/torch.py:695-698``: the stock ``TorchDistSaveShardedStrategy``
  plans and finishes its torch.distributed.checkpoint save on process group ``None`` (the default group: NCCL on
  GPUs, under the watchdog's timeout), so megamu writes through its own strategy with a group it chooses.
- ``dist_checkpointing/serialization.py:426``: after the sharded write, ``save`` holds one default-group barrier
  (rank 0 writes metadata.json first, a small file): the only wait megamu leaves on the default group.
- torch ``torch.distributed.checkpoint.save`` takes ``process_group``: its plan and finish collectives run there.
"""

import importlib
import inspect
from pathlib import Path


def _line(module: str, lineno: int) -> str:
    return Path(importlib.import_module(module).__file__).read_text().splitlines()[lineno - 1]


def test_the_stock_torch_dist_strategy_plans_on_the_default_group():
    mod = "megatron.core.dist_checkpointing.strategies.torch"
    assert "save_state_dict_async_plan(" in _line(mod, 695)
    assert _line(mod, 696).strip() == "pyt_state_dict," and _line(mod, 697).strip() == "writer,"
    assert _line(mod, 698).strip() == "None,"  # process_group


def test_megatrons_save_leaves_one_short_barrier_on_the_default_group():
    assert _line("megatron.core.dist_checkpointing.serialization", 426).strip() == "torch.distributed.barrier()"


def test_torch_distributed_checkpoint_save_takes_a_process_group():
    import torch.distributed.checkpoint as dcp

    assert "process_group" in inspect.signature(dcp.save).parameters
