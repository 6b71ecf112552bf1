"""A Qwen3-MoE model on CPU: megatron-core's MoE layers with megamu's one CPU override (megamu.model.moe_cpu), against
transformers' Qwen3MoeForCausalLM (router: softmax, top-k, renormalised or not), forward and backward."""

import pytest
import torch

from megamu.convert import load_hf_into_model
from megamu.model import ModelArch, build_model
from megamu.model.config import moe_config_fields, moe_impl
from tests.numerics import reorder_rtol
from tests.tiny import save_tiny_model

SEQ = 24


def _ids(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (2, SEQ), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_logits_match_transformers_in_fp64(distributed, tmp_path, norm_topk_prob):
    from transformers import AutoModelForCausalLM

    hf_dir = save_tiny_model(tmp_path / "moe", "qwen3_moe", seed=2, vocab_size=300, norm_topk_prob=norm_topk_prob)
    arch = ModelArch.from_hf(hf_dir)
    assert (arch.num_experts, arch.moe_top_k, arch.moe_ffn_hidden_size) == (4, 2, 32)
    assert arch.moe_norm_topk_prob is norm_topk_prob
    model = build_model(arch, params_dtype=torch.float64)
    load_hf_into_model(model, arch, hf_dir)
    model.eval()
    ids = _ids(arch.vocab_size)
    with torch.no_grad():
        got = model(ids, torch.arange(SEQ).expand(2, SEQ), None)[..., : arch.vocab_size]
        # transformers 5 defaults to torch._grouped_mm experts, which take no fp64: its per-expert loop instead
        want = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float64,
                                                    experts_implementation="eager")(ids).logits
    # In fp64 only the order of sums differs (megatron's fused QKV / fc1, the experts' weighted sum), except the
    # routing weights: both sides softmax the router logits in fp32 (HF: softmax(dtype=float); megatron:
    # moe_router_dtype="fp32"), HF over all experts then renormalising, megatron over the top k. So the bound is
    # fp32's for a softmax over num_experts terms, once per layer. A wrong routing (other experts, unnormalised
    # weights) is off by orders of magnitude more.
    rtol = reorder_rtol(torch.float32, arch.num_experts, depth=arch.num_layers)
    rtol += reorder_rtol(torch.float64, arch.hidden_size, depth=2 * arch.num_layers + 1)
    err = ((got - want).norm() / want.norm()).item()
    assert err <= rtol, f"relative logits difference {err:.2e} > {rtol:.1e}"
    print(f"qwen3_moe norm_topk_prob={norm_topk_prob}: relative logits difference {err:.2e} (bound {rtol:.1e})")


def test_backward_reaches_router_and_every_expert(distributed, tmp_path):
    hf_dir = save_tiny_model(tmp_path / "moe", "qwen3_moe", seed=4, vocab_size=300)
    arch = ModelArch.from_hf(hf_dir)
    model = build_model(arch)
    load_hf_into_model(model, arch, hf_dir)
    model.train()
    logits = model(_ids(arch.vocab_size), torch.arange(SEQ).expand(2, SEQ), None)[..., : arch.vocab_size]
    logits.logsumexp(-1).mean().backward()
    grads = {n: p.grad for n, p in model.named_parameters() if ".mlp." in n}
    assert len(grads) == arch.num_layers * (1 + 2 * arch.num_experts)  # router + fc1/fc2 per expert
    for name, g in grads.items():
        assert g is not None and g.abs().sum() > 0, name  # 48 tokens x top-2 of 4 experts: every expert is used


def test_stock_router_refuses_cpu_which_the_override_replaces(distributed, tmp_path):
    """Why megamu.model.moe_cpu exists: megatron-core 0.16.1's TopKRouter gate moves its weight to CUDA. If a newer
    megatron-core runs it on CPU, this fails and the override can go."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.moe.router import TopKRouter

    from megamu.model import spec as spec_module
    from megamu.model.moe_cpu import CpuTopKRouter

    arch = ModelArch.from_hf(save_tiny_model(tmp_path / "moe", "qwen3_moe", seed=5, vocab_size=300))
    built = spec_module.layer_spec(arch, "local")
    assert built.submodules.mlp.submodules.router is CpuTopKRouter
    stock = get_gpt_layer_local_spec(num_experts=arch.num_experts, qk_layernorm=True, normalization="RMSNorm")
    assert stock.submodules.mlp.submodules.router is TopKRouter
    router = build_model(arch).decoder.layers[0].mlp.router
    x = torch.randn(3, arch.hidden_size)
    with pytest.raises((AssertionError, RuntimeError), match="CUDA"):
        TopKRouter.gating(router, x)  # megatron's own gate, on the same router
    # the override computes what megatron's RouterGatingLinearFunction does on a device it runs on: x @ W.T in fp32
    assert torch.equal(router.gating(x), torch.mm(x.float(), router.weight.float().t()))


def test_the_device_decides_experts_dispatcher_and_router():
    cpu, gpu = moe_impl("local"), moe_impl("transformer_engine")
    assert (cpu.grouped_gemm, cpu.token_dispatcher, cpu.cpu_router) == (False, "allgather", True)
    assert (gpu.grouped_gemm, gpu.token_dispatcher, gpu.cpu_router) == (True, "alltoall", False)
    arch = ModelArch.from_hf(_qwen3_moe_config(norm_topk_prob=True))
    fields = moe_config_fields(arch, "local")
    assert fields["moe_router_pre_softmax"] is False  # top-k logits, then softmax: HF's renormalised weights
    unnormalised = ModelArch.from_hf(_qwen3_moe_config(norm_topk_prob=False))
    assert moe_config_fields(unnormalised, "local")["moe_router_pre_softmax"] is True  # softmax of all, then top-k
    assert fields["moe_token_dispatcher_type"] == "allgather" and not fields["moe_grouped_gemm"]
    assert moe_config_fields(arch, "transformer_engine")["moe_token_dispatcher_type"] == "alltoall"


def _qwen3_moe_config(**kw):
    from tests.tiny import tiny_hf_config

    return tiny_hf_config("qwen3_moe", vocab_size=300, **kw)


@pytest.mark.parametrize("field,value", [("mlp_only_layers", [0]), ("decoder_sparse_step", 2)])
def test_mixed_dense_and_sparse_stacks_are_refused(field, value):
    with pytest.raises(ValueError, match=field):
        ModelArch.from_hf(_qwen3_moe_config(**{field: value}))


def test_the_model_config_carries_the_expert_layout_of_the_process_groups(distributed, monkeypatch):
    """megatron-core's TE grouped linear reads the expert layout from its TransformerConfig, not from the process
    groups: ``self.expert_parallel = self.config.expert_model_parallel_size > 1`` and every expert weight gets
    ``allreduce = not (is_expert and self.expert_parallel)`` (megatron/core/extensions/transformer_engine.py:1506 and
    :1551 in 0.16.1), and DDP all-reduces over the data-parallel group every parameter whose ``allreduce`` is true
    (distributed/distributed_data_parallel.py:122, :563). A config left at EP 1 on EP-2 groups sums each rank's own
    experts' gradients with another rank's different experts. Expert TP defaults to TP when not given
    (model_parallel_config.py:413-414)."""
    from megatron.core import parallel_state

    import megamu.model.build as build

    seen, real = {}, build.transformer_config

    def capture(arch, **kw):  # the real config, then stop: GPTModel cannot be built on fake EP-2 groups
        seen["config"] = real(arch, **kw)
        raise RuntimeError("captured")

    monkeypatch.setattr(build, "transformer_config", capture)
    monkeypatch.setattr(parallel_state, "get_expert_model_parallel_world_size", lambda: 2)
    monkeypatch.setattr(parallel_state, "get_expert_tensor_parallel_world_size", lambda: 1)
    arch = ModelArch.from_hf(_qwen3_moe_config(num_experts=4))
    with pytest.raises(RuntimeError, match="captured"):
        build.build_model(arch)
    config = seen["config"]
    assert config.expert_model_parallel_size == 2 and config.expert_tensor_parallel_size == 1


def _module_with(params: dict[str, torch.Tensor]) -> torch.nn.Module:
    """A module tree whose named_parameters are exactly ``params``' names."""
    root = torch.nn.Module()
    for name, t in params.items():
        *path, leaf = name.split(".")
        mod = root
        for part in path:
            if not hasattr(mod, part):
                mod.add_module(part, torch.nn.Module())
            mod = getattr(mod, part)
        mod.register_parameter(leaf, torch.nn.Parameter(torch.zeros_like(t)))
    return root


def test_grouped_expert_weights_map_to_the_canonical_names(distributed, tmp_path):
    """The GPU spec's TEGroupedMLP holds local expert j's linear as ``experts.linear_fc1.weight<j>``
    (megatron/core/extensions/transformer_engine.py:1746-1754 in 0.16.1: TEGroupedLinear's sharded state dict maps
    ``weight{gemm_idx}`` to local expert gemm_idx, global index ep_rank * num_gemms + gemm_idx); the converter's
    canonical names are SequentialMLP's ``experts.local_experts.<j>.linear_fc1.weight``. A model with the grouped
    names loads the HF checkpoint (no "missing tensors") and gives back the same tensors for export."""
    from megamu.convert.tp import full_state_dict, load_full_state_dict
    from megamu.model.spec import canonical_param_name

    hf_dir = save_tiny_model(tmp_path / "moe", "qwen3_moe", seed=3, vocab_size=300)
    arch = ModelArch.from_hf(hf_dir)
    model = build_model(arch)
    load_hf_into_model(model, arch, hf_dir)
    canonical = {n: t.clone() for n, t in full_state_dict(model, arch)}
    # TE's per-expert parameter name, read from megatron-core's own source (not rebuilt here): the key its grouped
    # linear's sharded_state_dict reads for local expert gemm_idx
    import re
    from pathlib import Path

    import megatron.core.extensions as ext

    source = (Path(ext.__file__).parent / "transformer_engine.py").read_text()
    te_leaves = set(re.findall(r'full_state_dict\[f"(\w+)\{gemm_idx\}"\]', source))
    assert "weight" in te_leaves  # megatron-core 0.16.1: full_state_dict[f"weight{gemm_idx}"] (and bias)
    grouped = {}
    for name, p in model.named_parameters():  # the same tensors under TEGroupedMLP's names
        if ".local_experts." in name:
            head, rest = name.split(".local_experts.")
            j, linear, leaf = rest.split(".")
            assert leaf in te_leaves
            name = f"{head}.{linear}.{leaf}{j}"
        grouped[name] = p.detach()
    assert any(n.endswith("mlp.experts.linear_fc1.weight0") for n in grouped)
    assert {canonical_param_name(n) for n in grouped} == set(canonical)
    te_like = _module_with(grouped)
    load_full_state_dict(te_like, arch, canonical.__getitem__, names=canonical)  # raises on missing/unexpected
    back = dict(full_state_dict(te_like, arch))
    assert set(back) == set(canonical)
    assert all(torch.equal(back[n], canonical[n]) for n in canonical)


def _router_grads(model, arch, coeff: float, weight: float) -> dict:
    from megamu.model.config import scale_router_aux_loss

    for p in model.parameters():
        p.grad = None
    for m in model.modules():  # the coefficient the config carries (the model is built once, at coefficient 1)
        if hasattr(m, "config") and getattr(m.config, "moe_aux_loss_coeff", None) is not None:
            m.config.moe_aux_loss_coeff = coeff
    logits = model(_ids(arch.vocab_size), torch.arange(SEQ).expand(2, SEQ), None)[..., : arch.vocab_size]
    scale_router_aux_loss(weight)
    logits.logsumexp(-1).mean().backward()
    scale_router_aux_loss(1.0)
    return {n: p.grad.clone() for n, p in model.named_parameters() if n.endswith("mlp.router.weight")}


def test_router_aux_loss_is_megatrons_switch_loss_off_by_default(distributed, tmp_path):
    """--moe-router-load-balancing-type aux_loss / --moe-aux-loss-coeff: megatron-core's own load-balancing loss.
    Reference, Switch Transformer (arXiv:2101.03961) eq. 4 as megatron-core 0.16.1 states it
    (transformer/moe/moe_utils.py ``switch_load_balancing_loss_func``): coeff * E * sum_i f_i P_i, f_i the share of
    the T * k routed slots that go to expert i, P_i the mean softmax probability of expert i. The router weights'
    gradient gains exactly its derivative (the router's input held fixed, so: the last layer's router, which no other
    layer's aux loss reaches), scaled by the micro-batch's weight."""
    from megamu.errors import ConfigError
    from megamu.model.config import check_load_balancing

    hf_dir = save_tiny_model(tmp_path / "moe", "qwen3_moe", seed=4, vocab_size=300)
    arch = ModelArch.from_hf(hf_dir)
    assert moe_config_fields(arch, "local")["moe_router_load_balancing_type"] == "none"  # off by default
    assert moe_config_fields(arch, "local")["moe_aux_loss_coeff"] == 0.0
    model = build_model(arch, params_dtype=torch.float64, load_balancing=("aux_loss", 1.0))
    load_hf_into_model(model, arch, hf_dir)
    model.train()
    inputs: dict[str, torch.Tensor] = {}
    for name, m in model.named_modules():
        if name.endswith("mlp.router"):
            m.register_forward_pre_hook(lambda mod, args, name=name: inputs.__setitem__(name, args[0].detach()))
    base = _router_grads(model, arch, 0.0, 1.0)
    coeff, k, experts = 0.01, arch.moe_top_k, arch.num_experts
    for weight in (1.0, 0.25):
        got = _router_grads(model, arch, coeff, weight)
        last = f"decoder.layers.{arch.num_layers - 1}.mlp.router.weight"
        assert all(g.sub(base[n]).abs().max() > 0 for n, g in got.items())  # every router feels it
        # the last layer's router alone sees no other layer's aux loss through the hidden states it reads
        for name, g in [(n, g) for n, g in got.items() if n.endswith(last)]:
            w = dict(model.named_parameters())[name].detach().clone().requires_grad_(True)
            x = inputs[name.rsplit(".", 1)[0]].reshape(-1, arch.hidden_size).to(torch.float32)
            logits = x @ w.to(torch.float32).t()  # moe_router_dtype fp32, as megatron's gate
            probs = torch.softmax(logits, -1)
            routed = torch.zeros_like(probs).scatter(1, logits.topk(k, -1).indices, 1.0)
            tokens = x.shape[0]
            f, p = routed.sum(0) / (tokens * k), probs.sum(0) / tokens
            aux = coeff * experts * (f * p).sum()
            (want,) = torch.autograd.grad(aux * weight, w)
            delta = g - base[name]
            assert delta.abs().max() > 0, name
            # fp32 softmax and sums over 48 tokens: fp32's reorder bound, relative to the gradient's size
            bound = reorder_rtol(torch.float32, tokens * experts) * want.abs().max().item()
            assert (delta - want.to(delta.dtype)).abs().max().item() <= bound, (name, weight)
    for kind, c in (("none", 0.01), ("aux_loss", 0.0), ("aux_loss", -1.0), ("sinkhorn", 1.0)):
        with pytest.raises(ConfigError):
            check_load_balancing(kind, c)
