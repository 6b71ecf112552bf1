"""GPU twin of the CPU offload tests: megatron DDP + DistributedOptimizer (bf16) hand their memory back for a rollout.

Skipped where there is no CUDA device: a skip here is not a pass, and CI (CPU only) never runs it. The local spec is
used, so transformer-engine is not needed.
"""

import pytest
import torch

from megamu.algo import ALGORITHM_PRESETS
from megamu.convert import load_hf_into_model
from megamu.model import ModelArch, build_model, unwrap
from megamu.runtime.device import Device
from megamu.training import OptimizerConfig, build_optimizer, compute_logprobs, train_step
from tests.tiny import save_tiny_model
from tests.training.helpers import make_samples, set_behaviour

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
CUDA = Device("cuda")


def test_offload_frees_the_trainer_memory_and_reload_is_bitwise(distributed, tmp_path):
    hf = save_tiny_model(tmp_path / "hf", "qwen2", seed=12)
    arch = ModelArch.from_hf(hf)
    model = build_model(arch, device=CUDA, transformer_impl="local", bf16=True)
    opt = build_optimizer(model, OptimizerConfig(lr=1e-4), CUDA)
    load_hf_into_model(model, arch, hf)
    samples = make_samples(2, 4, arch.vocab_size, seed=13)
    set_behaviour(samples, compute_logprobs(model, samples, micro_batch_size=8), noise=0.1)
    train_step(model, opt, samples, ALGORITHM_PRESETS["mu-grpo"], micro_batch_size=8)
    params = {n: p.detach().clone() for n, p in unwrap(model).named_parameters()}
    states = {n: {k: v.clone() for k, v in opt.param_state(p).items()} for n, p in unwrap(model).named_parameters()}
    n = sum(p.numel() for p in params.values())

    torch.cuda.synchronize()
    train = opt.memory()
    # bf16 params (2 B), fp32 grad buffer (4 B), fp32 main params and two moments (4 B each; DP=1 owns all)
    assert train.params >= 2 * n and train.grads >= 4 * n and train.main_params >= 4 * n and train.moments >= 8 * n
    allocated = torch.cuda.memory_allocated()
    opt.offload()
    freed = allocated - torch.cuda.memory_allocated()
    assert opt.memory().total == 0
    assert freed >= train.total  # every counted storage left the device (the caching allocator may free more)

    opt.reload()
    assert opt.memory() == train
    for name, p in unwrap(model).named_parameters():
        assert torch.equal(p.detach(), params[name]), name
        got = opt.param_state(p)
        for k in ("exp_avg", "exp_avg_sq", "main_param"):
            assert torch.equal(got[k], states[name][k]), (name, k)
    after = train_step(model, opt, samples, ALGORITHM_PRESETS["mu-grpo"], micro_batch_size=8)
    assert not opt.last_step_skipped and torch.isfinite(torch.tensor(after["loss"]))
