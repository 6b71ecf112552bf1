"""The lr schedule against megatron-core's own ``OptimizerParamScheduler`` (the reference Megatron-LM users know).

Pinned upstream facts (megatron-core 0.16.1, megatron/core/optimizer_param_scheduler.py):
- ``get_lr`` l.227-230: linear warmup ``init_lr + (max_lr - init_lr) * num_steps / lr_warmup_steps`` while
  ``num_steps <= lr_warmup_steps``;
- l.233-238: ``constant`` returns max_lr, and past ``lr_decay_steps`` every style returns min_lr;
- l.247-258, 279: ``decay_ratio = (num_steps - warmup) / (decay_steps - warmup)``, linear ``1 - ratio``, cosine
  ``0.5 (cos(pi ratio) + 1)``, ``lr = min_lr + coeff (max_lr - min_lr)``;
- l.281-293: ``step(increment)`` adds to ``num_steps`` and sets every param group's lr.
megamu's update k runs at Megatron's step k + 1 (documented in OptimizerConfig).
"""

import math

import pytest
import torch
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from megamu.errors import ConfigError
from megamu.training.optimizer import OptimizerConfig


class _Groups:
    """What the scheduler touches of an optimiser: its param groups."""

    def __init__(self):
        self.param_groups = [{"params": [torch.zeros(1)]}]


def megatron_lrs(cfg: OptimizerConfig, updates: int) -> list[float]:
    sched = OptimizerParamScheduler(
        _Groups(), init_lr=0.0, max_lr=cfg.lr, min_lr=cfg.min_lr, lr_warmup_steps=cfg.lr_warmup_iters,
        lr_decay_steps=cfg.lr_decay_iters or updates, lr_decay_style=cfg.lr_decay_style, start_wd=0.0, end_wd=0.0,
        wd_incr_steps=updates, wd_incr_style="constant")
    lrs = []
    for _ in range(updates):
        sched.step(1)
        lrs.append(sched.optimizer.param_groups[0]["lr"])
    return lrs


@pytest.mark.parametrize("style", ["constant", "linear", "cosine"])
@pytest.mark.parametrize("warmup", [0, 3])
def test_lr_at_is_megatrons_schedule_one_step_on(style, warmup):
    cfg = OptimizerConfig(lr=2e-3, min_lr=1e-4, lr_warmup_iters=warmup, lr_decay_style=style, lr_decay_iters=12)
    ours = [cfg.lr_at(k) for k in range(16)]  # 4 updates past the decay: min_lr
    for k, (a, b) in enumerate(zip(ours, megatron_lrs(cfg, 16), strict=True)):
        assert math.isclose(a, b, rel_tol=1e-12, abs_tol=1e-18), (style, warmup, k, a, b)


def test_hand_computed_points():
    cos = OptimizerConfig(lr=1.0, min_lr=0.0, lr_decay_style="cosine", lr_decay_iters=10)
    assert math.isclose(cos.lr_at(4), 0.5)  # step 5 of 10: cos(pi/2) = 0 -> halfway
    assert cos.lr_at(9) == 0.0 and cos.lr_at(20) == 0.0
    lin = OptimizerConfig(lr=1.0, min_lr=0.2, lr_warmup_iters=2, lr_decay_style="linear", lr_decay_iters=10)
    assert [lin.lr_at(0), lin.lr_at(1)] == [0.5, 1.0]  # warmup: 1/2, 2/2
    assert math.isclose(lin.lr_at(5), 0.2 + 0.8 * (1 - 4 / 8))  # step 6: 4 of 8 decay steps


@pytest.mark.parametrize("kwargs, field", [
    ({"lr_decay_style": "exponential"}, "lr_decay_style"),
    ({"min_lr": 2.0}, "min_lr"),
    ({"lr_decay_style": "cosine", "lr_decay_iters": 2, "lr_warmup_iters": 5}, "lr_decay_iters"),
    ({"lr_decay_style": "linear", "lr_decay_iters": 4, "lr_warmup_iters": 4}, "lr_decay_iters"),
])
def test_bad_schedules_name_their_field(kwargs, field):
    with pytest.raises(ConfigError) as e:
        OptimizerConfig(lr=1.0, **kwargs)
    assert e.value.field == field
