"""The optimisation phase: micro-batching, loss scaling over micro-batches and data-parallel ranks, the optimiser,
checkpoints."""

from megamu.training.batch import PackedBatch, data_parallel_share, pack, split_micro_batches
from megamu.training.checkpoint import CheckpointError, latest_iteration, load_checkpoint, save_checkpoint
from megamu.training.optimizer import OptimizerConfig, build_optimizer
from megamu.training.step import compute_logprobs, response_logprobs, train_step

__all__ = [
    "CheckpointError", "OptimizerConfig", "PackedBatch", "build_optimizer", "compute_logprobs", "data_parallel_share",
    "latest_iteration", "load_checkpoint", "pack", "response_logprobs", "save_checkpoint", "split_micro_batches",
    "train_step",
]
