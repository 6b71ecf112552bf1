"""End to end on a mixture-of-experts model: `pretrain_mu_grpo.py`, 2 stages, a tiny random Qwen3-MoE (4 experts,
top-2), the in-process engine (transformers' Qwen3MoeForCausalLM on the exported HF folder), TP=1."""

import pytest
import torch

from tests.e2e.runs import MU, STAGES, final_weights, flags, launch, records
from tests.tiny import save_tiny_model


@pytest.mark.slow
def test_two_stage_mu_grpo_on_qwen3_moe(tmp_path):
    from transformers import AutoModelForCausalLM

    model = save_tiny_model(tmp_path / "tiny-qwen3-moe", "qwen3_moe", seed=3)
    save = tmp_path / "run"
    launch(flags(model, save))
    updates = records(save, "update")
    assert [u["update"] for u in updates] == list(range(STAGES * MU))
    # θ = β at each stage's first update: megatron's MoE model (megamu's CPU router) and transformers' give the same
    # log-prob to every sampled token, after the stage-0 weights were converted and after stage 1's export
    for first in (updates[0], updates[MU]):
        assert first["ratio_mean"] == pytest.approx(1.0, abs=1e-4)
        assert first["approx_kl"] == pytest.approx(0.0, abs=1e-6)
    assert [s["stage"] for s in records(save, "stage")] == list(range(STAGES))
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == str(STAGES * MU)
    # the experts and the router trained, and the export is a Qwen3-MoE transformers loads
    final = final_weights(save)
    assert type(AutoModelForCausalLM.from_pretrained(save / "hf" / "final")).__name__ == "Qwen3MoeForCausalLM"
    for part in ("mlp.gate.weight", "mlp.experts.0.gate_proj.weight", "mlp.experts.3.down_proj.weight"):
        name = f"model.layers.0.{part}"
        assert not torch.equal(final[name], _hf_tensor(model, name)), name


@pytest.mark.slow
def test_two_data_parallel_ranks_on_qwen3_moe(tmp_path):
    """DP = 2 at EP = 1: each rank holds every expert; gradients, exports and checkpoints agree across ranks."""
    model = save_tiny_model(tmp_path / "tiny-qwen3-moe", "qwen3_moe", seed=3)
    save = tmp_path / "run"
    launch(flags(model, save), nproc=2)
    updates = records(save, "update")
    assert [u["update"] for u in updates] == list(range(STAGES * MU))
    for first in (updates[0], updates[MU]):
        assert first["ratio_mean"] == pytest.approx(1.0, abs=1e-4)


@pytest.mark.slow
def test_tensor_parallel_moe_training_is_refused_with_the_reason(tmp_path):
    model = save_tiny_model(tmp_path / "tiny-qwen3-moe", "qwen3_moe", seed=3)
    proc = launch(flags(model, tmp_path / "run", "--tensor-model-parallel-size", "2"), nproc=2, check=False)
    assert proc.returncode != 0
    assert "sequence parallelism for MoE" in proc.stdout + proc.stderr


def _hf_tensor(folder, name: str) -> torch.Tensor:
    from megamu.convert.io import SafetensorsDir

    return SafetensorsDir(folder).get(name)


@pytest.mark.parametrize("world, flag", [("2", "--expert-model-parallel-size"), ("3", "--expert-model-parallel-size")])
def test_expert_parallelism_is_refused_on_cpu_and_must_divide_the_world(tmp_path, monkeypatch, capsys, world, flag):
    # world 2: TP x EP divides it, but megatron-core runs EP on CUDA only; world 3: TP x EP = 2 does not divide it
    from megamu.arguments import parse_args

    model = save_tiny_model(tmp_path / "tiny-qwen3-moe", "qwen3_moe", seed=3)
    monkeypatch.setenv("WORLD_SIZE", world)
    with pytest.raises(SystemExit) as e:
        parse_args(flags(model, tmp_path / "bad", "--expert-model-parallel-size", "2"))
    message = str(e.value) + capsys.readouterr().err
    assert flag in message
    assert ("CUDA only" in message) if world == "2" else ("does not divide world size 3" in message)
