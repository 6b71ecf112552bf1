"""The memory plan's `checkpoint` phase (per GPU) and host plan (per node): by hand, against the upstream facts they
rest on (torch's pinned-memory rounding, megatron's pinned copies), and the 7B and 30B-A3B examples' dry runs."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from megamu.errors import ConfigError
from megamu.memory.memory_plan import GIB, MemoryPlanConfig, ModelShape, plan_memory
from megamu.memory.memory_plan_phases import (
    SAVE_CHUNK_ELEMENTS,
    SLAB_BYTES,
    mirror_slab_bytes,
    pack_slabs,
    param_tensor_numels,
    pow2_ceil,
)
from tests.memory.test_moe_plan import QWEN3_30B_A3B
from tests.memory.test_plan import QWEN25_MATH_7B, tiny_qwen2

REPO = Path(__file__).resolve().parents[2]
SITE = Path(__import__("torch").__file__).parent.parent


def _rows(plan, phase):
    return {r.part: r.bytes for r in plan.rows() if r.phase == phase and r.counted}


def test_checkpoint_phase_is_the_resident_state_plus_one_chunk():
    c = MemoryPlanConfig(model=tiny_qwen2(), micro_batch_size=2, max_seq_len=16, tp=2, dp=4, rollout_mode="async")
    plan = plan_memory(c)
    train, save = _rows(plan, "training"), _rows(plan, "checkpoint")
    state = ["CUDA context + NCCL (trainer)", "params (bf16)", "fp32 main params", "fp32 grad buffer",
             "Adam moments (fp32 x2)"]
    assert {k: save[k] for k in state} == {k: train[k] for k in state}
    chunk = [v for k, v in save.items() if k not in state]
    assert chunk == [SAVE_CHUNK_ELEMENTS * 4] == [128 * 2**20]  # one fp32 buffer, not the optimiser state again
    assert plan.total("checkpoint") == sum(train[k] for k in state) + 128 * 2**20


def test_a_save_that_cannot_fit_is_refused_naming_the_checkpoint_phase():
    # a tiny model and micro-batch: training needs less than the save's 128 MiB buffer on top of the state
    c = MemoryPlanConfig(model=tiny_qwen2(), micro_batch_size=1, max_seq_len=4, rollout_mode="async",
                         cuda_context_gib=0.001, gpu_memory_gib=0.1)
    assert plan_memory(c).total("training") < 0.1 * GIB < plan_memory(c).total("checkpoint")
    with pytest.raises(ConfigError) as err:
        plan_memory(c).check()
    assert err.value.field == "gpu_memory_gib" and "phase 'checkpoint'" in err.value.message
    assert "phase 'training'" not in err.value.message


def test_torch_rounds_pinned_allocations_up_to_a_power_of_two():
    """The fact the host plan rests on, read from the installed torch's header (torch 2.13:
    ATen/core/CachingHostAllocator.h, ``allocate``: ``PowerOf2Ceil`` below ``pinned_max_round_threshold``, which
    c10/core/AllocatorConfig.h leaves unbounded)."""
    header = (SITE / "torch/include/ATen/core/CachingHostAllocator.h").read_text()
    assert re.search(r"size <= pinned_max_round_threshold\(\)[^}]*return c10::llvm::PowerOf2Ceil\(size\);", header)
    config = (SITE / "torch/include/c10/core/AllocatorConfig.h").read_text()
    assert "size_t pinned_max_round_threshold_{std::numeric_limits<size_t>::max()};" in config
    assert [pow2_ceil(n) for n in (0, 1, 2, 3, 1024, 1025, 1_090_000_000)] == [0, 1, 2, 4, 1024, 2048, 2**31]


def test_megatron_pins_a_fresh_copy_of_each_param_buffer():
    """megatron-core 0.16.1 distributed/param_and_grad_buffer.py ``offload_to_cpu``: one pinned copy per buffer."""
    src = (SITE / "megatron/core/distributed/param_and_grad_buffer.py").read_text()
    body = src[src.index("    def offload_to_cpu(self, move_params"):src.index("    def reload_from_cpu(")]
    assert "self.param_data_cpu = self.param_data.cpu().pin_memory()" in body


def test_host_plan_by_hand():
    m = tiny_qwen2()  # h 64, 2 layers, q 64, kv 64 (2 heads x 16 x 2), f 96, vocab 100 -> 256 at TP 2, qkv bias
    c = MemoryPlanConfig(model=m, micro_batch_size=1, max_seq_len=8, tp=2, dp=2, servers_per_gpu=1,
                         host_memory_gib=64, ranks_per_node=2, reward_workers=4)
    host = {r.part: (r.phase, r.bytes) for r in plan_memory(c).host.rows()}
    layer = [64 * 128 // 2, 64 * 64 // 2, 64, 64, 128 // 2, 2 * 96 * 64 // 2, 96 * 64 // 2]
    tensors = layer * 2 + [128 * 64] * 2 + [64]  # embedding and output layer: 256 / 2 rows of 64
    n = sum(tensors)
    assert host["trainer processes (2 x 6 GiB, estimate)"] == ("every phase", 12 * GIB)
    # one slab per rank holds main params and moments (3 x 4 n / DP 2 bytes), plus one slab of slack
    mirrored = 4 * n // 2 + 8 * n // 2
    assert host["offload mirror, pinned slabs (main params, Adam moments; 2 ranks)"] == ("every phase",
                                                                                         2 * 2 * SLAB_BYTES)
    assert mirrored < SLAB_BYTES
    assert host["megatron's pinned param buffers, 2^k rounded (2 ranks)"] == ("every phase", 2 * pow2_ceil(2 * n))
    assert host["reward workers (4 x 0.5 GiB, estimate)"] == ("every phase", 2 * GIB)
    assert host["SGLang servers (2 x 8 GiB, estimate)"] == ("rollout (servers up)", 16 * GIB)
    # a save stages each shard on its main replica (DP rank 0): ranks 0 and 1 of the world, TP 0 and 1 at DP 0, both
    # on the first node
    assert host["optimiser state on the host (fp32 x 3, pageable; writers: 2 dense)"] == (
        "checkpoint save", 2 * 12 * n)
    staged = sum(pow2_ceil(2 * t) for t in tensors)
    assert host["megatron's pinned staging of the model, 2^k rounded (writers: 2 dense)"] == (
        "checkpoint save", 2 * staged)
    # staged: servers and the save never overlap, the node needs the larger; colocated servers add to the save
    always = 12 * GIB + 2 * 2 * SLAB_BYTES + 2 * pow2_ceil(2 * n) + 2 * GIB
    assert plan_memory(c).host.total() == always + max(16 * GIB, 2 * 12 * n + 2 * staged)
    colocated = plan_memory(MemoryPlanConfig(**{**c.__dict__, "rollout_mode": "colocated"})).host
    assert colocated.total() == always + 16 * GIB + 2 * 12 * n + 2 * staged


def test_only_the_writing_replicas_stage_a_save_on_the_host():
    """TP 1 x DP 4 on one node of 4: one dense writer (DP rank 0), not four; MoE at EP 2: the experts' writers are
    the first TP x EP = 2 ranks (expert-DP rank 0 of each expert-DP group), each with its half of the experts."""
    m = tiny_qwen2()
    c = MemoryPlanConfig(model=m, micro_batch_size=1, max_seq_len=8, tp=1, dp=4, host_memory_gib=64, ranks_per_node=4)
    host = {r.part: r.bytes for r in plan_memory(c).host.rows()}
    n = sum(sum(t) for t in param_tensor_numels(m, 1, 1))
    assert host["optimiser state on the host (fp32 x 3, pageable; writers: 1 dense)"] == 12 * n
    moe = ModelShape(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, ffn_hidden_size=96,
                     vocab_size=128, num_experts=4, moe_top_k=2, moe_ffn_hidden_size=32)
    c = MemoryPlanConfig(model=moe, micro_batch_size=1, max_seq_len=8, tp=1, ep=2, dp=4, host_memory_gib=64,
                         ranks_per_node=4)
    dense, experts = param_tensor_numels(moe, 1, 2)
    host = {r.part: r.bytes for r in plan_memory(c).host.rows()}
    assert host["optimiser state on the host (fp32 x 3, pageable; writers: 1 dense, 2 expert)"] == (
        12 * sum(dense) + 2 * 12 * sum(experts))


def test_the_slab_estimate_bounds_first_fit_on_the_7b_models_tensors():
    """The plan's slab count for a rank against pack_slabs over the 7B's real tensor sizes (TP 2, all on one rank)."""
    from megamu.memory.memory_plan_phases import param_tensor_numels

    dense, _ = param_tensor_numels(ModelShape.from_hf_config(QWEN25_MATH_7B), 2, 1)
    sizes = [4 * n for n in dense] * 3
    slab, places = pack_slabs(sizes)
    packed = (1 + max(i for i, _ in places)) * slab
    assert slab == 2 * SLAB_BYTES  # the 1.09 GB fp32 embedding shard sets the slab size
    assert sum(sizes) <= packed <= mirror_slab_bytes(sum(sizes), max(sizes))
    per_tensor = sum(pow2_ceil(s) for s in sizes)
    assert packed < 0.7 * per_tensor  # one pinned buffer per tensor would round 1.09 GB up to 2 GiB, and so on


def _dry_run(script: str, config: dict, tmp_path: Path, host_gib: int, *extra: str, **env):
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps(config))
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"problem": "1 + 1?", "answer": "2"}) + "\n")
    full = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "SGLANG_URL", "NNODES", "GPUS")}
    full.update(HF_CHECKPOINT=str(model), PROMPT_DATA=str(data), RUN_ROOT=str(tmp_path / "runs"),
                PYTHON=sys.executable, PYTHONPATH=str(REPO), HOST_MEMORY_GIB=str(host_gib), **env)
    return subprocess.run(["bash", str(REPO / "examples" / script), *extra], env=full, capture_output=True,
                          text=True, timeout=300, cwd=REPO)


def _host_total(out: str) -> str:
    return next(s for s in out.splitlines() if s.startswith("  total (every phase"))


@pytest.mark.slow
def test_the_30b_a3b_dry_run_fits_a_1tb_node_and_a_768_gib_node_is_refused_with_the_fix(tmp_path):
    ok = _dry_run("qwen3-30b-a3b-8xh200.sh", QWEN3_30B_A3B, tmp_path, 2048, "--dry-run")
    assert ok.returncode == 0, ok.stdout[-3000:] + ok.stderr[-3000:]
    assert "\ncheckpoint\n" in ok.stdout and "host (GiB per node of 8 trainer ranks; RAM 2048 GiB)" in ok.stdout
    assert _host_total(ok.stdout).endswith("fits")
    # issue 50's done-when: a 1 TiB node holds it, now that one replica of each shard stages a save (1 dense writer,
    # 8 expert writers, where every rank staged everything: 1081 GiB)
    one_tib = _dry_run("qwen3-30b-a3b-8xh200.sh", QWEN3_30B_A3B, tmp_path, 1024, "--dry-run")
    assert one_tib.returncode == 0, one_tib.stdout[-3000:] + one_tib.stderr[-3000:]
    total = _host_total(one_tib.stdout)
    assert total.endswith("fits") and float(total.split()[-4]) <= 1024, total
    assert "writers: 1 dense, 8 expert)" in one_tib.stdout
    refused = _dry_run("qwen3-30b-a3b-8xh200.sh", QWEN3_30B_A3B, tmp_path, 768, "--dry-run")
    assert refused.returncode != 0
    assert "--host-memory-gib" in refused.stderr and "--no-save-optim" in refused.stderr, refused.stderr[-2000:]
    fixed = _dry_run("qwen3-30b-a3b-8xh200.sh", QWEN3_30B_A3B, tmp_path, 768, "--dry-run", "--no-save-optim")
    assert fixed.returncode == 0, fixed.stderr[-2000:]
    assert _host_total(fixed.stdout).endswith("fits") and "optimiser state on the host" not in fixed.stdout


@pytest.mark.slow
def test_the_7b_baseline_dry_run_prints_checkpoint_and_host_and_fits(tmp_path):
    proc = _dry_run("qwen2.5-math-7b/run_grpo.sh", {**QWEN25_MATH_7B, "architectures": ["Qwen2ForCausalLM"],
                                                   "max_position_embeddings": 4096}, tmp_path, 2048, DRY_RUN="1")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    save = proc.stdout.split("\ncheckpoint\n", 1)[1].split("\nrollout")[0]
    assert "optimiser state streamed to host" in save and save.rstrip().endswith("fits")
    assert "host (GiB per node of 4 trainer ranks; RAM 2048 GiB)" in proc.stdout
    assert _host_total(proc.stdout).endswith("fits")


def test_the_node_ram_is_read_on_a_gpu_machine_and_given_for_a_dry_run_elsewhere(tmp_path):
    """A GPU run plans the host against its own cgroup limit or RAM; a run parsed without GPUs (a dry run on a
    login machine) plans the host only with --host-memory-gib: this machine's RAM is not the node's."""
    from megamu.arguments import parse_args
    from megamu.runtime.device import Device
    from megamu.runtime.host_memory import host_memory_bytes
    from tests.tiny import save_tiny_model
    from tools import gpu_check

    hf = save_tiny_model(tmp_path / "hf", "qwen2", seed=3)
    gpu = parse_args(gpu_check.stage_flags(hf, tmp_path / "run", True), device=Device("cuda"))
    assert gpu.memory.host_memory_gib == pytest.approx(host_memory_bytes() / GIB)  # the cgroup's limit, or the RAM
    flags = gpu_check.stage_flags(hf, tmp_path / "run", True) + ["--dry-run"]  # the GPU run's flags, checked here
    assert parse_args(flags, device=Device("cpu")).memory.host_memory_gib is None
    assert plan_memory(parse_args(flags, device=Device("cpu")).memory).host is None
    given = parse_args(flags + ["--host-memory-gib", "512"], device=Device("cpu")).memory
    assert given.host_memory_gib == 512 and plan_memory(given).host.host_memory_gib == 512
