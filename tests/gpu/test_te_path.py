"""The GPU path: Transformer Engine layer spec, bf16 (Float16Module), megatron DDP + DistributedOptimizer.

Skipped where there is no CUDA device or no transformer-engine: a skip here is not a pass, and CI (CPU only) never
runs these. The CPU suite checks the same properties on the local spec.
"""

import importlib.util

import pytest
import torch

from megamu.algo import ALGORITHM_PRESETS
from megamu.convert import load_hf_into_model
from megamu.model import ModelArch, build_model, forward_logprobs, unwrap
from megamu.runtime.device import Device
from megamu.training import (
    OptimizerConfig,
    build_optimizer,
    compute_logprobs,
    load_checkpoint,
    save_checkpoint,
    train_step,
)
from tests.tiny import save_tiny_model
from tests.training.helpers import make_samples, set_behaviour

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or importlib.util.find_spec("transformer_engine") is None,
        reason="needs a CUDA device and transformer-engine",
    ),
]


CUDA = Device("cuda")


def te_model(hf, *, bf16: bool):
    arch = ModelArch.from_hf(hf)
    model = build_model(arch, device=CUDA, transformer_impl="transformer_engine", bf16=bf16)
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
    opt = build_optimizer(model, OptimizerConfig(lr=1e-3, clip_grad=1.0), CUDA)
    samples = make_samples(4, 4, arch.vocab_size, seed=3)
    set_behaviour(samples, compute_logprobs(model, samples, micro_batch_size=8), noise=0.0)
    algo = ALGORITHM_PRESETS["mu-grpo"]
    first = train_step(model, opt, samples, algo, micro_batch_size=8)
    assert first["ratio_mean"] == pytest.approx(1.0, abs=2e-2)  # θ = β up to bf16 rounding
    losses = [train_step(model, opt, samples, algo, micro_batch_size=8)["loss"] for _ in range(4)]
    assert losses[-1] < first["loss"]


def _anchored_samples(model, arch, seed: int):
    samples = make_samples(2, 4, arch.vocab_size, seed=seed)
    set_behaviour(samples, compute_logprobs(model, samples, micro_batch_size=8), noise=0.0)
    return samples


def test_weights_loaded_after_building_the_optimizer_survive_the_first_update(distributed, tmp_path):
    # trainer.Run's order: the bf16 optimiser copies its fp32 main weights at construction, before the load
    hf = save_tiny_model(tmp_path / "hf", "llama", seed=4)
    arch = ModelArch.from_hf(hf)
    model = build_model(arch, device=CUDA, transformer_impl="transformer_engine", bf16=True)
    opt = build_optimizer(model, OptimizerConfig(lr=1e-6, clip_grad=1.0), CUDA)
    load_hf_into_model(model, arch, hf)
    loaded = {n: p.detach().float().clone() for n, p in model.named_parameters()}
    train_step(model, opt, _anchored_samples(model, arch, seed=5), ALGORITHM_PRESETS["mu-grpo"], micro_batch_size=8)
    for n, p in model.named_parameters():
        # an update of ~lr moves a bf16 weight by at most one bf16 step; the random init differs by O(0.01)
        torch.testing.assert_close(p.detach().float(), loaded[n], rtol=2**-7, atol=1e-5, msg=n)


def test_weight_decay_skips_biases_and_1d_parameters(distributed, tmp_path):
    hf = save_tiny_model(tmp_path / "hf", "qwen2", seed=6)  # q/k/v biases
    model, arch = te_model(hf, bf16=False)
    lr, wd = 1e-2, 0.5
    opt = build_optimizer(model, OptimizerConfig(lr=lr, weight_decay=wd, clip_grad=0.0), CUDA)
    samples = _anchored_samples(model, arch, seed=7)
    for s in samples:
        s.advantage = 0.0  # zero loss and gradient: Adam's update is 0, only AdamW's decoupled decay moves weights
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    train_step(model, opt, samples, ALGORITHM_PRESETS["mu-grpo"], micro_batch_size=8)
    for n, p in model.named_parameters():
        decays = not (n.endswith(".bias") or p.dim() == 1)
        expected = before[n] * (1 - lr * wd) if decays else before[n]
        torch.testing.assert_close(p.detach(), expected, rtol=1e-6, atol=0, msg=n)


def test_non_finite_gradients_skip_the_update_and_a_run_of_them_stops(distributed, tmp_path):
    hf = save_tiny_model(tmp_path / "hf", "qwen2", seed=8)
    model, arch = te_model(hf, bf16=True)
    opt = build_optimizer(model, OptimizerConfig(lr=1e-3, max_skipped_steps=1), CUDA)
    samples = _anchored_samples(model, arch, seed=9)
    norm = next(p for n, p in model.named_parameters() if n.endswith("final_layernorm.weight"))
    with torch.no_grad():
        norm[0] = float("nan")  # every logit, loss and gradient becomes nan
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    train_step(model, opt, samples, ALGORITHM_PRESETS["mu-grpo"], micro_batch_size=8)
    assert opt.last_step_skipped and opt.skipped_steps == 1 and opt.iteration == 0
    with pytest.raises(FloatingPointError, match="max_skipped_steps 1"):
        train_step(model, opt, samples, ALGORITHM_PRESETS["mu-grpo"], micro_batch_size=8)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), before[n], rtol=0, atol=0, equal_nan=True, msg=n)


def test_checkpoint_restores_moments_and_fp32_main_weights(distributed, tmp_path):
    hf = save_tiny_model(tmp_path / "hf", "qwen3", seed=10)  # q/k norms
    model, arch = te_model(hf, bf16=True)
    cfg = OptimizerConfig(lr=1e-4)
    opt = build_optimizer(model, cfg)
    samples = _anchored_samples(model, arch, seed=11)
    for _ in range(2):
        train_step(model, opt, samples, ALGORITHM_PRESETS["mu-grpo"], micro_batch_size=8)
    save_checkpoint(tmp_path / "save", 2, model, arch, opt, extra={})
    saved = {n: opt.param_state(p) for n, p in unwrap(model).named_parameters()}
    # the fp32 main weights carry what bf16 rounds away: restoring them from the bf16 model would lose updates
    assert any(not torch.equal(saved[n]["main_param"], p.detach().float()) for n, p in unwrap(model).named_parameters())

    fresh = build_model(arch, device=CUDA, transformer_impl="transformer_engine", bf16=True)
    fresh_opt = build_optimizer(fresh, cfg)
    assert load_checkpoint(tmp_path / "save", fresh, arch, fresh_opt)["iteration"] == 2
    for n, p in unwrap(fresh).named_parameters():
        got = fresh_opt.param_state(p)
        for k in ("exp_avg", "exp_avg_sq", "main_param"):
            assert torch.equal(got[k], saved[n][k]), (n, k)
