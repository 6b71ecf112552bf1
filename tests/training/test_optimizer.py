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
    assert opt.state_dict() == {"iteration": 5, "skipped_steps": 0, "skipped_in_a_row": 0}


def test_config_rejects_bad_values_naming_the_field():
    with pytest.raises(ValueError, match="lr"):
        OptimizerConfig(lr=0)
    with pytest.raises(ValueError, match="clip_grad"):
        OptimizerConfig(lr=1.0, clip_grad=-1)
    assert OptimizerConfig(lr=1.0, lr_warmup_iters=0).lr_at(0) == 1.0
    assert math.isclose(OptimizerConfig(lr=1.0, lr_warmup_iters=2).lr_at(0), 0.5)


def _set_grads(model, value: float) -> None:
    for p in model.parameters():
        p.grad = torch.full_like(p, value)


def test_non_finite_gradient_skips_the_update_and_only_a_run_of_them_stops(distributed):
    torch.manual_seed(0)
    model = Toy()
    opt = build_optimizer(model, OptimizerConfig(lr=0.1, max_skipped_steps=2))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt.zero_grad()
    _set_grads(model, float("nan"))
    norm, _ = opt.step()
    assert math.isnan(norm) and opt.last_step_skipped and opt.skipped_steps == 1
    for n, p in model.named_parameters():  # nothing moved, no Adam state created, LR schedule not advanced
        assert torch.equal(p.detach(), before[n])
    assert opt.param_state(model.proj.weight) is None and opt.iteration == 0
    _set_grads(model, 1.0)
    opt.step()
    assert not opt.last_step_skipped and opt.iteration == 1 and opt.skipped_in_a_row == 0
    for _ in range(2):  # two in a row are allowed ...
        _set_grads(model, float("inf"))
        opt.step()
    assert opt.state_dict() == {"iteration": 1, "skipped_steps": 3, "skipped_in_a_row": 2}
    _set_grads(model, float("inf"))
    with pytest.raises(FloatingPointError, match="3th update in a row.*max_skipped_steps 2"):
        opt.step()  # ... a third is not
    with pytest.raises(ValueError, match="max_skipped_steps"):
        OptimizerConfig(lr=1.0, max_skipped_steps=-1)


def test_offload_spills_grads_and_moments_and_reload_is_bitwise(distributed, tmp_path):
    def run(offload: bool):
        torch.manual_seed(1)
        model = Toy()
        opt = build_optimizer(model, OptimizerConfig(lr=0.1))
        g = torch.Generator().manual_seed(2)
        stats = []
        for _ in range(3):
            opt.zero_grad()
            for p in model.parameters():
                p.grad = torch.randn(p.shape, generator=g)
            opt.step()
            if offload:
                train = opt.memory()
                opt.offload(tmp_path)
                stats.append((train, opt.memory(), sum(f.stat().st_size for f in tmp_path.iterdir())))
                opt.reload()
        return model, opt, stats

    ref, ref_opt, _ = run(False)
    model, opt, stats = run(True)
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p.detach(), q.detach()), n
        for k in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(opt.param_state(p)[k], ref_opt.param_state(q)[k]), (n, k)
    n_params = sum(p.numel() for p in model.parameters())  # 4 + 2 + 2 fp32 values
    for train, rollout, spilled in stats:
        assert (train.params, train.grads, train.moments) == (4 * n_params, 4 * n_params, 8 * n_params)
        assert (rollout.params, rollout.grads, rollout.moments) == (4 * n_params, 0, 0)
        assert spilled == 8 * n_params  # both moments on disk while offloaded ...
    assert list(tmp_path.iterdir()) == []  # ... and the file gone after reload


def test_megatron_param_and_grad_buffer_offload_keeps_views_and_values(distributed, monkeypatch):
    """megatron-core's own buffer offload (what the GPU path calls), on CPU tensors: the buffer is built on the CPU by
    answering its torch.cuda.current_device() with "cpu", and presetting param_data_cpu avoids the CUDA pin."""
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.distributed.param_and_grad_buffer import _ParamAndGradBuffer
    from megatron.core.process_groups_config import ProcessGroupCollection

    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")
    groups = ProcessGroupCollection()  # as megatron's DistributedDataParallel passes them
    groups.tp = parallel_state.get_tensor_model_parallel_group()
    groups.dp_cp = parallel_state.get_data_parallel_group(with_context_parallel=True)
    torch.manual_seed(3)
    params = [torch.nn.Parameter(torch.randn(s).to(torch.bfloat16)) for s in ((5, 3), (7,), (2, 2))]
    buf = _ParamAndGradBuffer(
        DistributedDataParallelConfig(use_distributed_optimizer=True, grad_reduce_in_fp32=True),
        torch.bfloat16, torch.float32, params, parallel_state.get_data_parallel_group(), bucket_size=None,
        param_to_name={p: f"p{i}" for i, p in enumerate(params)}, gradient_scaling_factor=1.0,
        param_indices=list(range(len(params))), nccl_ub=False, pg_collection=groups,
    )
    shares = lambda t, flat: t.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
    assert all(shares(p, buf.param_data) and shares(p.main_grad, buf.grad_data) for p in params)
    values = [p.detach().clone() for p in params]
    for p in params:
        p.main_grad.fill_(1.0)
    buf.param_data_cpu = torch.empty_like(buf.param_data)
    buf.offload_to_cpu(move_params=True, move_grads=True)
    assert buf.param_data.untyped_storage().nbytes() == 0 and buf.grad_data.untyped_storage().nbytes() == 0
    buf.reload_from_cpu(move_params=True, move_grads=True)
    assert buf.param_data.untyped_storage().nbytes() == buf.param_data.numel() * 2
    for p, v in zip(params, values):
        assert torch.equal(p.detach(), v)  # bitwise
        assert shares(p, buf.param_data) and shares(p.main_grad, buf.grad_data)  # views survive
        assert torch.count_nonzero(p.main_grad) == 0  # gradients come back zeroed
    # an optimiser step through the views lands in the flat buffer
    for p in params:
        p.main_grad.fill_(0.5)
        p.grad = p.main_grad.to(p.dtype)
    torch.optim.SGD(params, lr=1.0).step()
    for p, v in zip(params, values):
        assert torch.equal(p.detach(), (v.float() - 0.5).to(torch.bfloat16))


def test_memory_counts_the_adam_moments_not_the_step_counters():
    """What offload moves: torch AdamW's per-parameter states hold a scalar "step" tensor beside the two moments
    (megatron-core's fallback without TE/apex keeps it on the CPU, and a reload moves it to the GPU)."""
    import torch

    from megamu.training.optimizer import adam_moments

    params = [torch.nn.Parameter(torch.ones(3, 4)), torch.nn.Parameter(torch.ones(5))]
    opt = torch.optim.AdamW(params, lr=0.1)
    sum(p.sum() for p in params).backward()
    opt.step()
    assert all("step" in st and torch.is_tensor(st["step"]) for st in opt.state.values())
    moments = adam_moments(opt.state.values())
    assert len(moments) == 4 and sum(m.numel() for m in moments) == 2 * (12 + 5)
    assert all(m.shape == p.shape for m, p in zip(moments, [params[0], params[0], params[1], params[1]]))
