"""Two ranks under torchrun (gloo): DP=2 gradient invariance for every aggregation, TP=1 vs TP=2 after one update,
checkpoints saved at TP=2 loaded at TP=1 and back (see workers/parallel_worker.py for the assertions)."""

from pathlib import Path

import pytest

from megamu.tiny import save_tiny_model
from tests.torchrun import run_torchrun

WORKER = Path(__file__).parent / "workers" / "parallel_worker.py"


# qwen3: its q/k norms are replicated over TP but each rank sees only its heads' part of their gradient.
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_data_and_tensor_parallel_training_and_resharding(tmp_path, family):
    hf = save_tiny_model(tmp_path / "hf", family, seed=4, vocab_size=48)
    proc = run_torchrun(WORKER, 2, str(hf), str(tmp_path / "ckpt"), timeout=240)
    print(proc.stdout)
    assert proc.stdout.strip().endswith("OK")
    assert "max rel grad diff" in proc.stdout and "TP=1 checkpoint loaded at TP=2" in proc.stdout
