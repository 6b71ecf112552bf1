from pathlib import Path

import pytest

from tests.tiny import save_tiny_model
from tests.torchrun import run_torchrun

pytestmark = pytest.mark.slow  # a torchrun world (TP=2)

WORKER = Path(__file__).parent / "workers" / "tp_parity.py"


def test_tp1_vs_tp2_logprobs_entropy_and_gradients(tmp_path):
    # vocab 300: at TP=2 both ranks hold real tokens (256 + 44) and padding (212 rows), so the split is exercised
    dirs = [save_tiny_model(tmp_path / fam, fam, seed=i, vocab_size=300)
            for i, fam in enumerate(("llama", "qwen2", "qwen3"))]
    proc = run_torchrun(WORKER, 2, *dirs, timeout=240)
    assert proc.stdout.count("OK ") == 2 * 3  # every family on both ranks
