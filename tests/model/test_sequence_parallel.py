"""megatron-core's sequence parallelism on CPU at TP 2 against TP 1 (tests/model/workers/sequence_parallel.py):
log-probs, entropies and every gradient, fp64, rows of odd length; and the padding to a multiple of TP alone."""

from pathlib import Path

import pytest

from tests.tiny import save_tiny_model
from tests.torchrun import run_torchrun

pytestmark = pytest.mark.slow  # a torchrun world (TP=2)

WORKER = Path(__file__).parent / "workers" / "sequence_parallel.py"


def test_tp2_sequence_parallel_matches_tp1_logprobs_and_gradients(tmp_path):
    # qwen3: q/k norms (partial over heads and over tokens), untied output layer; llama: tied embeddings, whose
    # output layer reads the gathered positions through the embedding's weight; qwen3_moe: megatron-core trains MoE
    # at TP > 1 only with SP (transformer/moe/moe_layer.py:379), the router's weight is SP-marked and the experts are
    # split over TP. vocab 300: both TP ranks hold padding
    families = ("qwen3", "llama", "qwen3_moe")
    dirs = [save_tiny_model(tmp_path / fam, fam, seed=i, vocab_size=300) for i, fam in enumerate(families)]
    proc = run_torchrun(WORKER, 2, *map(str, dirs), timeout=300)
    assert proc.stdout.count("OK ") == 2 * len(families), proc.stdout[-2000:]  # every family on both ranks
