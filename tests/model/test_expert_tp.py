"""Experts at their own tensor-parallel size (megatron-core's MoE parallel folding, ``--expert-tensor-parallel-size``):
on 4 CPU ranks, attention at TP 2 + SP and experts at ETP 1 x EP 2 against TP 1 (log-probs, entropies, every gradient,
fp64), and a torch_dist checkpoint saved there loaded at two other layouts (tests/model/workers/expert_tp.py)."""

from pathlib import Path

import pytest

from tests.tiny import save_tiny_model
from tests.torchrun import run_torchrun

pytestmark = pytest.mark.slow  # a torchrun world of 4 ranks

WORKER = Path(__file__).parent / "workers" / "expert_tp.py"


def test_tp2_sp_with_experts_at_etp1_ep2_matches_tp1_and_its_checkpoint_loads_elsewhere(tmp_path):
    hf = save_tiny_model(tmp_path / "moe", "qwen3_moe", seed=8, vocab_size=300)  # 4 experts, top-2
    proc = run_torchrun(WORKER, 4, str(hf), str(tmp_path / "torch_dist"), timeout=420)
    assert proc.stdout.count("vs TP1: outputs") == 4, proc.stdout[-2000:]
    assert proc.stdout.count("loaded at TP 1 ETP 1 x EP 1") == 4
    assert proc.stdout.count("loaded at TP 2 ETP 2 x EP 1") == 4
    assert proc.stdout.count("micro-batch counts agree over ETP x EP") == 4
