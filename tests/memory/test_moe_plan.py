"""The memory plan of a mixture-of-experts model: parameter counts against transformers and Qwen3-30B-A3B's published
sizes, the expert-parallel split by hand, and the 8xH200 example's dry run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megamu.errors import ConfigError
from megamu.memory.memory_plan import GIB, MemoryPlanConfig, ModelShape, plan_memory

REPO = Path(__file__).resolve().parents[2]
# Qwen3-30B-A3B's config.json (public facts, huggingface.co/Qwen/Qwen3-30B-A3B)
QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 2048,
    "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
    "intermediate_size": 6144, "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8,
    "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [], "vocab_size": 151936,
    "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": False,
    "hidden_act": "silu", "attention_bias": False, "torch_dtype": "bfloat16",
}


def test_parameter_count_matches_transformers(tmp_path):
    from transformers import AutoModelForCausalLM

    from tests.tiny import save_tiny_model

    out = save_tiny_model(tmp_path / "moe", "qwen3_moe")
    hf = AutoModelForCausalLM.from_pretrained(out)
    shape = ModelShape.from_hf_config(json.loads((out / "config.json").read_text()))
    assert (shape.num_experts, shape.moe_top_k, shape.moe_ffn_hidden_size, shape.qk_norm) == (4, 2, 32, True)
    assert shape.num_parameters() == hf.num_parameters()
    experts = sum(p.numel() for n, p in hf.named_parameters() if ".mlp.experts." in n)
    assert shape.expert_params() == experts


def test_qwen3_30b_a3b_has_its_published_sizes():
    m = ModelShape.from_hf_config(QWEN3_30B_A3B)
    assert m.num_parameters() == pytest.approx(30.5e9, rel=2e-3)  # "30.5B in total"
    split, whole = m.param_counts()
    active = split + whole + m.expert_params() * m.moe_top_k // m.num_experts
    assert active == pytest.approx(3.3e9, rel=0.02)  # "3.3B activated"


def _example(**kw) -> MemoryPlanConfig:
    base = dict(model=ModelShape.from_hf_config(QWEN3_30B_A3B), micro_batch_size=1, max_seq_len=8192,
                max_response_len=8192 - 1024, tp=1, ep=8, dp=8, recompute_granularity="full")
    return MemoryPlanConfig(**{**base, **kw})


def test_expert_parallel_trainer_state_by_hand():
    m = ModelShape.from_hf_config(QWEN3_30B_A3B)
    h, v, layers = 2048, 151936, 48
    attention = h * (4096 + 1024) + 4096 * h  # q, k, v; o
    norms = 2 * h + 2 * 128 + 128 * h  # two RMSNorms, q/k norms, router (whole on every rank)
    dense = layers * (attention + norms) + 2 * v * h + h  # 151936 = 1187 x 128: megatron pads nothing at TP 1
    experts = layers * 128 * 3 * h * 768
    assert m.expert_params() == experts
    rows = {r.part: r.bytes for r in plan_memory(_example()).rows() if r.phase == "training"}
    local = dense + experts // 8  # 16 of 128 experts per GPU
    assert rows["params (bf16)"] == 2 * local
    assert rows["fp32 grad buffer"] == 4 * local
    # DistributedOptimizer: dense state sharded over DP 8, expert state over expert-DP = DP / EP = 1
    assert rows["fp32 main params"] == 4 * dense // 8 + 4 * (experts // 8)
    assert rows["Adam moments (fp32 x2)"] == 8 * dense // 8 + 8 * (experts // 8)
    # without EP every GPU would hold all 128 experts: bf16 weights alone 8x larger
    assert plan_memory(_example(ep=1)).total("training") > plan_memory(_example()).total("training") + 100 * GIB


def test_activations_follow_the_active_experts():
    plan = {r.part: r.bytes for r in plan_memory(_example(recompute_granularity=None)).rows()}
    dense_like = ModelShape.from_hf_config({**QWEN3_30B_A3B, "num_experts": 0})
    dense_plan = {r.part: r.bytes for r in plan_memory(_example(model=dense_like, ep=1,
                                                                recompute_granularity=None)).rows()}
    tokens, layers, e = 8192, 48, 2
    # per token and layer: SwiGLU over k = 8 experts of 768 (5 x 6144 values), dispatch 2 k h, router 2E fp32 + E + 4k
    moe = (5 * 8 * 768 * e + 2 * 8 * 2048 * e + 2 * 128 * 4 + 128 + 4 * 8) * tokens * layers
    dense = 5 * 6144 * e * tokens * layers  # a dense SwiGLU of width 6144 (intermediate_size)
    assert plan["activations, no recompute"] - dense_plan["activations, no recompute"] == moe - dense


@pytest.mark.parametrize("kw, field", [
    (dict(ep=3), "ep"),  # 128 experts do not split 3 ways
    (dict(ep=8, dp=4), "ep"),  # expert-DP would be DP / EP = 1/2
    (dict(tp=3), "tp"),
])
def test_bad_expert_layouts_name_their_field(kw, field):
    with pytest.raises(ConfigError) as err:
        _example(**kw)
    assert err.value.field == field


def test_expert_parallelism_needs_experts():
    with pytest.raises(ConfigError) as err:
        _example(model=ModelShape.from_hf_config({**QWEN3_30B_A3B, "num_experts": 0}))
    assert err.value.field == "ep"


def test_example_dry_run_prints_the_plan_and_the_memory_plan(tmp_path):
    model = tmp_path / "Qwen3-30B-A3B"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(QWEN3_30B_A3B))
    data = tmp_path / "deepscaler.jsonl"
    data.write_text(json.dumps({"problem": "1 + 1?", "answer": "2"}) + "\n")
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "SGLANG_URL", "NNODES", "GPUS")}
    env.update(HF_CHECKPOINT=str(model), PROMPT_DATA=str(data), RUN_ROOT=str(tmp_path / "runs"),
               PYTHON=sys.executable, PYTHONPATH=str(REPO), HOST_MEMORY_GIB="2048")  # a node's RAM, not this machine's
    proc = subprocess.run(["bash", str(REPO / "examples" / "qwen3-30b-a3b-8xh200.sh"), "--dry-run"], env=env,
                          capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert ("memory plan per GPU (GiB; device 140.4 GiB (H200: 143771 MiB in nvidia-smi); trainer TP 1 x DP 8, EP 8 "
            "(16 of 128 experts per GPU); micro-batch") in out
    training = out.split("\ntraining\n", 1)[1].split("\nrollout (staged)\n")[0]
    assert "activations, full recompute" in training and training.rstrip().endswith("fits")
    rollout = out.split("\nrollout (staged)\n", 1)[1]
    assert rollout.splitlines()[[i for i, s in enumerate(rollout.splitlines()) if "total" in s][0]].endswith("fits")
    plan = json.loads(out.strip().splitlines()[-1][len("plan: "):])
    assert (plan["num_stages"], plan["mu"], plan["total_updates"], plan["rollout_mode"]) == (4, 1024, 4096, "staged")
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").rglob("iter_*"))  # nothing started
