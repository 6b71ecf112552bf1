"""Qwen3-MoE conversion: HF -> megatron (megamu's mapping, and mbridge with megamu's SequentialMLP names) -> HF,
bitwise at TP=2, through a torch_dist checkpoint written at TP=1 (see workers/tp2_moe.py)."""

from pathlib import Path

import pytest
import torch

from megamu.convert.io import SafetensorsDir
from megamu.runtime.parallel import init_distributed
from megamu.training.torch_dist import hf_to_torch_dist
from tests.tiny import save_tiny_model
from tests.torchrun import run_torchrun

pytestmark = pytest.mark.slow  # torchrun worlds (TP=2, EP=2)

WORKER = Path(__file__).parent / "workers" / "tp2_moe.py"
EP_WORKER = Path(__file__).parent / "workers" / "ep2_moe.py"


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    reader = SafetensorsDir(folder)
    return {n: reader.get(n) for n in reader.keys()}


def test_qwen3_moe_round_trips_bitwise_at_tp2_and_cpu_refusals_are_where_documented(tmp_path):
    # vocab 300: at TP=2 both vocab shards hold real rows and the last one padding
    hf_dir = save_tiny_model(tmp_path / "qwen3_moe", "qwen3_moe", seed=6, vocab_size=300)
    init_distributed(1)
    dist_dir = hf_to_torch_dist(hf_dir, tmp_path / "torch_dist").parent  # mbridge at TP=1, local spec
    proc = run_torchrun(WORKER, 2, hf_dir, dist_dir, tmp_path / "mbridge", tmp_path / "megamu", timeout=600)
    assert proc.stdout.count("OK TP=2") == 2
    want = _tensors(hf_dir)
    assert sum(".mlp.experts." in n for n in want) == 2 * 4 * 3  # layers x experts x (gate, up, down)
    for export in ("mbridge", "megamu"):
        got = _tensors(tmp_path / export)
        assert set(got) == set(want), export
        for n in want:
            assert torch.equal(got[n], want[n]), (export, n)
    # megatron-core 0.16.1 on CPU: the allgather dispatcher's gather over TP x EP allocates on CUDA
    # (tensor_parallel/mappings.py:141); when a newer version runs these, docs/checkpoints.md must say so
    assert proc.stdout.count("FORWARD TP=2 refused") == 2
    assert proc.stdout.count("FORWARD EP=2 refused") == 2


def test_qwen3_moe_experts_split_over_ep2_round_trip_bitwise(tmp_path):
    """megamu's mapping at expert-parallel size 2 (each rank loads and exports its own experts by global index), and a
    torch_dist checkpoint written at EP=2 loads at EP=1 to the HF weights: megatron's sharded experts reshard."""
    from megamu.convert import load_hf_into_model
    from megamu.convert.tp import full_state_dict
    from megamu.model import ModelArch, build_model
    from megamu.training.checkpoint import load_model_checkpoint

    hf_dir = save_tiny_model(tmp_path / "qwen3_moe", "qwen3_moe", seed=7, vocab_size=300)
    proc = run_torchrun(EP_WORKER, 2, hf_dir, tmp_path / "export", tmp_path / "torch_dist", timeout=600)
    assert "OK EP=2 rank 0: experts 0..1" in proc.stdout and "OK EP=2 rank 1: experts 2..3" in proc.stdout
    want = _tensors(hf_dir)
    got = _tensors(tmp_path / "export")
    assert set(got) == set(want) and all(torch.equal(got[n], want[n]) for n in want)

    init_distributed(1)
    arch = ModelArch.from_hf(hf_dir)
    ref, loaded = build_model(arch), build_model(arch)
    load_hf_into_model(ref, arch, hf_dir)
    assert load_model_checkpoint(tmp_path / "torch_dist", loaded) == 0
    for (name, a), (_, b) in zip(full_state_dict(ref, arch), full_state_dict(loaded, arch)):
        assert torch.equal(a, b), name
