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
    grouped = {}
    for name, p in model.named_parameters():  # the same tensors under TEGroupedMLP's names
        if ".local_experts." in name:
            head, rest = name.split(".local_experts.")
            j, linear, leaf = rest.split(".")
            name = f"{head}.{linear}.{leaf}{j}"
        grouped[name] = p.detach()
    assert any(n.endswith("mlp.experts.linear_fc1.weight0") for n in grouped)
    assert {canonical_param_name(n) for n in grouped} == set(canonical)
    te_like = _module_with(grouped)
    load_full_state_dict(te_like, arch, canonical.__getitem__, names=canonical)  # raises on missing/unexpected
    back = dict(full_state_dict(te_like, arch))
    assert set(back) == set(canonical)
    assert all(torch.equal(back[n], canonical[n]) for n in canonical)
