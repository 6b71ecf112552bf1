"""Checkpoints interoperate with megatron-core itself, at TP=2 under torchrun (gloo): one written by plain
megatron-core code (megatron-core's GPTModel and its stock ``dist_checkpointing.save``, as Megatron-LM writes it)
loads into megamu bitwise, and megamu's loads into plain megatron-core bitwise, Adam moments included. The worker
also pins down where megatron-core 0.16.1's stock save refuses a CPU-only torch
(see workers/megatron_interop_worker.py).
"""

from pathlib import Path

import pytest

from tests.tiny import save_tiny_model
from tests.torchrun import run_torchrun

pytestmark = pytest.mark.slow  # a torchrun world (TP=2)

WORKER = Path(__file__).parent / "workers" / "megatron_interop_worker.py"


def test_plain_megatron_core_checkpoints_and_megamus_load_into_each_other(tmp_path):
    save_tiny_model(tmp_path / "hf", "qwen3", 5)  # q/k norms, untied embeddings: every kind of tensor
    proc = run_torchrun(WORKER, 2, tmp_path / "hf", tmp_path / "out", timeout=600)
    assert "stock dist_checkpointing.save on CPU: AssertionError in filesystem_async.py preload_tensors" in proc.stdout
    assert "plain megatron-core checkpoint loaded into megamu: bitwise" in proc.stdout
    assert "megamu checkpoint loaded by plain megatron-core: bitwise (weights and exp_avg)" in proc.stdout
    assert proc.stdout.rstrip().endswith("OK")
