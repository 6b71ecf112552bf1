"""The GPU path: Transformer Engine layer spec, bf16 (Float16Module), megatron DDP + DistributedOptimizer.

Skipped where there is no CUDA device or no transformer-engine: a skip here is not a pass, and CI (CPU only) never
runs these. The CPU suite checks the same properties on the local spec.
"""

import importlib.util

import pytest
import torch

from megamu.algo import ALGORITHM_PRESETS
from megamu.convert import load_hf_into_model
from megamu.model import ModelArch, build_model, forward_logprobs
from megamu.tiny import save_tiny_model
from megamu.training import OptimizerConfig, build_optimizer, compute_logprobs, train_step
from tests.training.helpers import make_samples, set_behaviour

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or importlib.util.find_spec("transformer_engine") is None,
        reason="needs a CUDA device and transformer-engine",
    ),
]


def te_model(hf, *, bf16: bool):
    arch = ModelArch.from_hf(hf)
    model = build_model(arch, transformer_impl="transformer_engine", bf16=bf16)
    load_hf_into_model(model, arch, hf)
    return model.cuda(), arch


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_te_spec_logprobs_match_transformers(distributed, tmp_path, family):
    from transformers import AutoModelForCausalLM

    hf = save_tiny_model(tmp_path / "hf", family, seed=1)
    model, arch = te_model(hf, bf16=False)
    ids = torch.randint(4, arch.vocab_size, (2, 24), device="cuda")
    with torch.no_grad():
        ours, _ = forward_logprobs(model, ids, temperature=0.7)
        ref_model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).cuda()
        ref = torch.log_softmax(ref_model(ids).logits.float() / 0.7, -1)[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]
    assert (ours.float() - ref).abs().max().item() < 2e-3  # TF32 matmuls in both


def test_bf16_distributed_optimizer_learns(distributed, tmp_path):
    hf = save_tiny_model(tmp_path / "hf", "qwen2", seed=2)
    model, arch = te_model(hf, bf16=True)
    opt = build_optimizer(model, OptimizerConfig(lr=1e-3, clip_grad=1.0))
    samples = make_samples(4, 4, arch.vocab_size, seed=3)
    set_behaviour(samples, compute_logprobs(model, samples, micro_batch_size=8), noise=0.0)
    algo = ALGORITHM_PRESETS["mu-grpo"]
    first = train_step(model, opt, samples, algo, micro_batch_size=8)
    assert first["ratio_mean"] == pytest.approx(1.0, abs=2e-2)  # θ = β up to bf16 rounding
    losses = [train_step(model, opt, samples, algo, micro_batch_size=8)["loss"] for _ in range(4)]
    assert losses[-1] < first["loss"]
