"""The memory plan's arithmetic against hand-computed values, transformers' parameter counts and the 7B runs."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from megamu.errors import ConfigError
from megamu.memory.memory_plan import GIB, H200_GIB, MemoryPlanConfig, ModelShape, plan_memory

# Qwen2.5-Math-7B's config.json (public facts, huggingface.co/Qwen/Qwen2.5-Math-7B)
QWEN25_MATH_7B = {
    "model_type": "qwen2", "hidden_size": 3584, "num_hidden_layers": 28, "num_attention_heads": 28,
    "num_key_value_heads": 4, "intermediate_size": 18944, "vocab_size": 152064, "tie_word_embeddings": False,
}
# examples/qwen2.5-math-7b/model.sh + examples/common.sh: TP 2 on 4 GPUs (DP 2), micro-batch 4, context 4096 of which
# the prompt is at most 1024, one SGLang server per GPU at TP 1 with --mem-fraction-static 0.85.
EXAMPLE = dict(micro_batch_size=4, max_seq_len=4096, max_response_len=4096 - 1024, params_dtype="bf16", tp=2, dp=2,
               servers_per_gpu=1, server_tp=1, mem_fraction_static=0.85)


def tiny_qwen2() -> ModelShape:
    return ModelShape(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, ffn_hidden_size=96,
                      vocab_size=100, qkv_bias=True)


def test_parameter_count_by_hand():
    # per layer: q 64x64 + 64 bias; k and v 64x32 + 32 bias each; o 64x64; gate, up, down 3 x 64x96; two norms of 64
    layer = (4096 + 64) + 2 * (2048 + 32) + 4096 + 3 * 6144 + 2 * 64
    assert layer == 30976
    # embedding and untied output layer 100x64 each, final norm 64
    assert tiny_qwen2().num_parameters() == 2 * layer + 2 * 6400 + 64 == 74816
    # TP 2: everything but the norms is split; the padded vocab (megatron: a multiple of 128 x TP) is 256
    split, whole = tiny_qwen2().param_counts(tp=2, vocab=256)
    assert whole == 2 * 128 + 64
    assert split == 2 * (layer - 128) + 2 * 256 * 64


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_parameter_count_matches_transformers(tmp_path, family):
    from transformers import AutoModelForCausalLM

    from tests.tiny import save_tiny_model

    out = save_tiny_model(tmp_path / family, family)
    config = json.loads((out / "config.json").read_text())
    hf = AutoModelForCausalLM.from_pretrained(out)
    assert ModelShape.from_hf_config(config).num_parameters() == hf.num_parameters()


def test_trainer_state_by_hand():
    m = tiny_qwen2()
    c = MemoryPlanConfig(model=m, micro_batch_size=1, max_seq_len=8, tp=2, dp=4, rollout_mode="async")
    rows = {r.part: r.bytes for r in plan_memory(c).rows() if r.phase == "training"}
    n = (2 * (30976 - 128) + 2 * 256 * 64) // 2 + (2 * 128 + 64)  # one TP rank's parameters
    assert rows["params (bf16)"] == 2 * n
    assert rows["fp32 grad buffer"] == 4 * n  # grad_reduce_in_fp32, not sharded
    assert rows["fp32 main params"] == 4 * n // 4  # DistributedOptimizer: sharded over DP 4
    assert rows["Adam moments (fp32 x2)"] == 8 * n // 4
    plain = {r.part: r.bytes for r in plan_memory(
        MemoryPlanConfig(model=m, micro_batch_size=1, max_seq_len=8, tp=2, dp=4, distributed_optimizer=False,
                         params_dtype="fp32", rollout_mode="async")).rows()}
    assert plain["params (fp32)"] == 4 * n and plain["fp32 main params"] == 0  # fp32 params are their own masters
    assert plain["Adam moments (fp32 x2)"] == 8 * n


def test_activations_and_logits_by_hand():
    m = tiny_qwen2()  # h 64, q 64, kv 2 x 2 x 16 = 64, f 96, heads 4, 2 layers, vocab 100 -> 256 at TP 2
    c = MemoryPlanConfig(model=m, micro_batch_size=3, max_seq_len=10, max_response_len=4, tp=2, rollout_mode="async")
    rows = {r.part: r.bytes for r in plan_memory(c).rows()}
    tokens = 3 * 10
    # per token per layer, bf16: 4h + (q + kv + q + kv/2 + q + 5f) / TP; fp32: heads/TP + 2 norm statistics;
    # per position, bf16: RoPE's cos and sin for q and k, 4 x head_dim
    per_layer = ((4 * 64 + (64 + 64 + 64 + 32 + 64 + 5 * 96) / 2) * 2 * tokens + (4 / 2 + 2) * 4 * tokens
                 + 4 * 16 * 10 * 2)
    head = 64 * 2 * tokens + 3 * 4 * 64 * 2  # final norm's input; the output layer's input at the scored positions
    assert rows["activations, no recompute"] == int(2 * per_layer + head)
    full = 2 * 64 * 2 * tokens + per_layer + head  # each layer's input, plus one layer rebuilt in the backward
    assert rows["activations, full recompute"] == int(full)
    # 6 fp32 tensors and one bool mask over [3 rows, 4 scored positions, 256 / 2 vocab entries] at T = 1; at T != 1
    # a 7th, the logits divided by T
    assert rows["logits and log-softmax temporaries (fp32)"] == (6 * 4 + 1) * 3 * 4 * 128
    hot = {r.part: r.bytes for r in plan_memory(replace(c, temperature=0.7)).rows()}
    assert hot["logits and log-softmax temporaries (fp32)"] == (7 * 4 + 1) * 3 * 4 * 128


def test_server_kv_cache_by_hand():
    # device 20 GiB, contexts 1 GiB, trainer offloaded (context only): the server starts with 20 - 1 - 1 = 18 GiB free
    m = tiny_qwen2()
    c = MemoryPlanConfig(model=m, micro_batch_size=1, max_seq_len=8, gpu_memory_gib=20, cuda_context_gib=1,
                         mem_fraction_static=0.5, rollout_mode="staged", offload_train=True)
    rows = {r.part: r.bytes for r in plan_memory(c).rows() if r.phase == "rollout (staged)"}
    weights = 74816 * 2
    assert rows["server: weights (bf16, TP 1)"] == weights
    assert rows["server: KV cache at mem_fraction_static 0.5"] == int(0.5 * 18 * GIB) - weights
    assert plan_memory(c).total("rollout (staged)") == 1 * GIB + 1 * GIB + int(0.5 * 18 * GIB)


def test_table_lists_every_part_and_a_total_per_phase():
    plan = plan_memory(MemoryPlanConfig(model=ModelShape.from_hf_config(QWEN25_MATH_7B), rollout_mode="staged",
                                        offload_train=True, **EXAMPLE))
    table = plan.table()
    for r in plan.rows():
        assert r.part in table
    assert table.count("  total") == len(plan.phases()) == 3  # training, checkpoint, rollout
    assert f"{plan.total('training') / GIB:8.2f}" in table


def mu_grpo_7b(**overrides) -> MemoryPlanConfig:
    # run_mu_grpo.sh: --rollout-mode staged; --offload-train defaults to on in staged mode (megamu.arguments)
    kw = dict(EXAMPLE, rollout_mode="staged", offload_train=True) | overrides
    return MemoryPlanConfig(model=ModelShape.from_hf_config(QWEN25_MATH_7B), **kw)


def grpo_7b(**overrides) -> MemoryPlanConfig:
    # run_grpo.sh: --rollout-mode colocated; the fixed protocol offloads the trainer and releases the servers
    kw = dict(EXAMPLE, rollout_mode="colocated", offload_train=True, release_during_training=True) | overrides
    return MemoryPlanConfig(model=ModelShape.from_hf_config(QWEN25_MATH_7B), **kw)


def test_paper_examples_fit_an_h200_in_every_phase():
    for config, phases in ((mu_grpo_7b(), ["training", "checkpoint", "rollout (staged)"]),
                           (grpo_7b(), ["training", "checkpoint", "rollout (colocated)"])):
        plan = plan_memory(config)
        assert plan.phases() == phases
        plan.check()
        for phase in phases:
            assert plan.total(phase) <= H200_GIB * GIB


def test_paper_7b_trainer_state_matches_the_notes():
    # /work/shared/notes/gpu-path.md, from the 7.62B parameters at TP2 x DP2: bf16 params 7.1 GiB, fp32 grad buffer
    # 14.2, fp32 main params 7.1, Adam moments 14.2 (GiB per GPU)
    assert ModelShape.from_hf_config(QWEN25_MATH_7B).num_parameters() == pytest.approx(7.62e9, rel=1e-3)
    rows = {r.part: r.bytes / GIB for r in plan_memory(mu_grpo_7b()).rows() if r.phase == "training"}
    assert rows["params (bf16)"] == pytest.approx(7.1, abs=0.05)
    assert rows["fp32 grad buffer"] == pytest.approx(14.2, abs=0.05)
    assert rows["fp32 main params"] == pytest.approx(7.1, abs=0.05)
    assert rows["Adam moments (fp32 x2)"] == pytest.approx(14.2, abs=0.05)


def test_old_colocated_settings_are_refused_in_the_training_phase():
    old = grpo_7b(offload_train=False, release_during_training=False)  # 0.85, servers resident through training
    plan = plan_memory(old)
    # issue 24: "Each H200 keeps about 92 GiB for SGLang" (started next to a trainer holding ~31 GiB)
    server = sum(r.bytes for r in plan.rows() if r.phase == "training" and r.part.startswith("server:") and r.counted)
    assert (server - 2 * GIB) / GIB == pytest.approx(92, abs=1.5)
    with pytest.raises(ConfigError) as err:
        plan.check()
    assert err.value.field == "gpu_memory_gib"
    assert "phase 'training'" in str(err.value)
    assert "overflows at 'activations, no recompute'" in str(err.value)
    assert "rollout (colocated)" not in str(err.value)  # its rollout phase still fits (138.9 GiB)


def test_kv_cache_must_be_positive():
    plan = plan_memory(mu_grpo_7b(gpu_memory_gib=20))  # 0.85 x (20 - 2 - 2) GiB < 14.2 GiB of weights
    assert "KV cache" in plan.table()  # the table is still there to read
    with pytest.raises(ConfigError, match="phase 'rollout \\(staged\\)': server would have no KV cache") as err:
        plan.check()
    assert err.value.field == "mem_fraction_static"


@pytest.mark.parametrize("field, value", [
    ("tp", 3), ("micro_batch_size", 0), ("params_dtype", "fp16"), ("recompute_granularity", "some"),
    ("rollout_mode", "sync"), ("mem_fraction_static", 1.0), ("gpu_memory_gib", -1), ("max_response_len", 5000),
    ("release_during_training", True),  # staged: no servers share the trainer's GPUs
])
def test_bad_values_name_their_field(field, value):
    with pytest.raises(ConfigError) as err:
        mu_grpo_7b(**{field: value})
    assert err.value.field == field


def test_moe_layouts_it_does_not_model_are_refused():
    for extra in ({"n_routed_experts": 64}, {"num_experts": 64, "shared_expert_intermediate_size": 512},
                  {"num_experts": 64, "mlp_only_layers": [0]}):
        with pytest.raises(ConfigError) as err:
            ModelShape.from_hf_config(dict(QWEN25_MATH_7B, num_experts_per_tok=2, moe_intermediate_size=64, **extra))
        assert err.value.field == "model"


def test_colocated_push_phase_by_hand():
    """The refresh as loop/staged.publish orders it (slime's train.py:82-88: offload_train, then onload_weights,
    update_weights, onload_kv): the trainer's context, the gathered model on rank 0, the live flattened buckets
    (megamu.engines.sglang.tensor_sync: one flattened copy per server TP rank), and each server's weights, resumed
    alone (SGLang 0.5.23 /resume_memory_occupation ``tags``: "weights" without "kv_cache")."""
    m = tiny_qwen2()
    c = MemoryPlanConfig(model=m, micro_batch_size=1, max_seq_len=8, rollout_mode="colocated", offload_train=True,
                         weight_push="memory", push_bucket_mb=1.0, push_bucket_copies=2, cuda_context_gib=0.5,
                         gpu_memory_gib=4.0)
    plan = plan_memory(c)
    phase = "push (colocated refresh)"
    assert phase in plan.phases()
    model_bf16 = m.num_parameters() * 2
    ctx = GIB // 2
    # trainer context + gathered model + 2 buckets + server context + server weights (TP 1: the whole model)
    assert plan.total(phase) == ctx + model_bf16 + 2 * 2**20 + ctx + model_bf16
    kv = [r for r in plan.rows() if r.phase == phase and "KV cache" in r.part]
    assert kv and not any(r.counted for r in kv)
    # a disk refresh gathers nothing: only the servers' resumed weights join the trainer's context
    disk = plan_memory(replace(c, weight_push="disk"))
    assert disk.total(phase) == ctx + ctx + model_bf16
    # not offloaded: the trainer's state is there during the push too
    held = plan_memory(replace(c, offload_train=False))
    training_state = sum(r.bytes for r in held.rows() if r.phase == "training" and r.part.startswith(
        ("params", "fp32", "Adam")))
    assert held.total(phase) == plan.total(phase) + training_state
    # staged and async runs have no push phase
    assert phase not in plan_memory(replace(c, rollout_mode="staged", weight_push=None)).phases()


def test_a_push_that_cannot_fit_is_refused():
    """7B (bf16 15.2 GiB) colocated with the trainer's state kept on the GPU and a small device: the training phase
    fits, the push (state + the gathered model + the server's weights) does not."""
    model = ModelShape.from_hf_config(QWEN25_MATH_7B)
    c = MemoryPlanConfig(model=model, **{**EXAMPLE, "micro_batch_size": 1, "max_seq_len": 1024,
                                         "max_response_len": 512}, rollout_mode="colocated", offload_train=False,
                         release_during_training=True, weight_push="memory", recompute_granularity="full")
    plan = plan_memory(c)
    need = plan.total("push (colocated refresh)") / GIB
    train = plan.total("training") / GIB
    assert need > train  # the gathered model and the servers' weights on top of the trainer's state
    tight = replace(c, gpu_memory_gib=(need + train) / 2)
    with pytest.raises(ConfigError, match="push"):
        plan_memory(tight).check()


def test_reference_policy_adds_one_copy_of_the_params_offloaded_with_the_trainer():
    """The KL term's π_ref (--use-kl-loss): the actor's parameters once more, by hand; with the trainer's state on the
    device during the rollout (--no-offload-train) it stays there too."""
    m = tiny_qwen2()
    n = (2 * (30976 - 128) + 2 * 256 * 64) // 2 + (2 * 128 + 64)  # one TP rank's parameters (test above)
    base = MemoryPlanConfig(model=m, micro_batch_size=1, max_seq_len=8, tp=2, dp=4, rollout_mode="staged")
    with_ref = replace(base, reference_model=True)
    rows = {(r.phase, r.part): r.bytes for r in plan_memory(with_ref).rows()}
    assert rows[("training", "reference policy params (bf16)")] == 2 * n
    assert plan_memory(with_ref).total("training") - plan_memory(base).total("training") == 2 * n
    assert ("rollout (staged)", "trainer reference policy params (bf16)") not in rows  # offloaded with the trainer
    kept = plan_memory(replace(with_ref, offload_train=False))
    assert {r.part: r.bytes for r in kept.rows() if r.phase == "rollout (staged)"}[
        "trainer reference policy params (bf16)"] == 2 * n
