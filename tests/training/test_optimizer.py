"""TorchAdamW wrapper against hand-computed AdamW: norm, clipping, warmup, weight-decay groups."""

import math

import pytest
import torch

from megamu.training.optimizer import OptimizerConfig, build_optimizer


class Toy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(2, 2)  # weight decayed, bias not
        self.norm = torch.nn.Parameter(torch.ones(2))  # 1-D: not decayed


def test_step_clips_by_global_norm_warms_up_and_skips_decay_on_1d(distributed):
    model = Toy()
    with torch.no_grad():
        model.proj.weight.copy_(torch.tensor([[1.0, -2.0], [0.5, 3.0]]))
        model.proj.bias.copy_(torch.tensor([0.1, -0.1]))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    g = {"proj.weight": torch.tensor([[3.0, 0.0], [0.0, -4.0]]), "proj.bias": torch.tensor([0.0, 12.0]),
         "norm": torch.tensor([0.0, 0.0])}
    cfg = OptimizerConfig(lr=0.1, weight_decay=0.5, clip_grad=6.5, lr_warmup_iters=4, adam_eps=1e-8)
    opt = build_optimizer(model, cfg)
    opt.zero_grad()
    for n, p in model.named_parameters():
        p.grad = g[n].clone()
    norm, lr = opt.step()
    assert norm == pytest.approx(13.0)  # sqrt(9 + 16 + 144)
    assert lr == pytest.approx(0.1 / 4)  # first of 4 warmup updates
    coeff = 6.5 / (13.0 + 1e-6)
    for n, p in model.named_parameters():
        # first AdamW step: m̂ = g, v̂ = g², so the step is lr * g / (|g| + eps); decay lr * wd * p on 2-D weights only
        clipped = g[n] * coeff
        wd = 0.5 if n == "proj.weight" else 0.0
        expected = before[n] * (1 - lr * wd) - lr * clipped / (clipped.abs() + 1e-8)
        torch.testing.assert_close(p.detach(), expected, rtol=1e-6, atol=1e-7)
    assert [opt.step()[1] for _ in range(4)] == pytest.approx([0.05, 0.075, 0.1, 0.1])
    assert opt.state_dict() == {"iteration": 5}


def test_config_rejects_bad_values_naming_the_field():
    with pytest.raises(ValueError, match="lr"):
        OptimizerConfig(lr=0)
    with pytest.raises(ValueError, match="clip_grad"):
        OptimizerConfig(lr=1.0, clip_grad=-1)
    assert OptimizerConfig(lr=1.0, lr_warmup_iters=0).lr_at(0) == 1.0
    assert math.isclose(OptimizerConfig(lr=1.0, lr_warmup_iters=2).lr_at(0), 0.5)
