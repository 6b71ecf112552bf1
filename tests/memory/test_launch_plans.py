"""The memory plan of real launches: slime's Qwen3-4B (scripts/run-qwen3-4B.sh: 8 x H200, TP 2, 8k responses,
--use-dynamic-batch-size --max-tokens-per-gpu 9216, colocated) and verl's Qwen2-7B GSM8K GRPO recipe
(examples/grpo_trainer/run_qwen2-7b.sh, as docs/coming-from-slime-verl.md translates it), on the models' public configs
(tests/fixtures/hf). Micro-batches are sized by the token budget, colocated servers release their memory while the
trainer trains as a GPU run's memory saver makes them, and an overflow names each flag that alone makes it fit."""

import json
import shlex
from dataclasses import replace
from pathlib import Path

import pytest

from megamu.arguments import check_memory, parse_args
from megamu.memory.memory_plan import GIB, H200_GIB, MemoryPlanConfig, ModelShape, padded_vocab, plan_memory

HF = Path(__file__).parent.parent / "fixtures" / "hf"


def qwen3_4b(**kw) -> MemoryPlanConfig:
    model = ModelShape.from_hf_config(json.loads((HF / "Qwen3-4B" / "config.json").read_text()))
    return MemoryPlanConfig(**{"model": model, "micro_batch_size": 8, "max_seq_len": 1024 + 8192,
                               "max_response_len": 8192, "tp": 2, "dp": 4, "recompute_granularity": "full", **kw})


def row(plan, phase: str, start: str):
    return next(r for r in plan.rows() if r.phase == phase and r.part.startswith(start))


def test_a_token_budget_bounds_the_micro_batch():
    budget = plan_memory(qwen3_4b(max_tokens_per_micro_batch=9216))
    one_row = plan_memory(qwen3_4b(micro_batch_size=1))
    eight_rows = plan_memory(qwen3_4b())
    assert budget.config.micro_batch_tokens == 9216 and eight_rows.config.micro_batch_tokens == 8 * 9216
    # the budget holds one 9216-token row: the activations of one row, not of eight, but for the output layer's
    # input (bf16, hidden 2560), kept at the scored positions: up to the budget's 9216, one row's 8192
    part = "activations, full recompute"
    assert row(budget, "training", part).bytes - row(one_row, "training", part).bytes == (9216 - 8192) * 2560 * 2
    assert row(eight_rows, "training", part).bytes > 7 * row(one_row, "training", part).bytes
    # logits: 25 bytes (6 fp32 temporaries and a bool mask) per scored position per local vocab row, at most the
    # budget's 9216 positions (one row scores 8192), TP 2 over Qwen3's vocab padded to 152064
    local_vocab = padded_vocab(151936, 2) // 2
    assert local_vocab == 76032
    assert row(budget, "training", "logits").bytes == 25 * 9216 * local_vocab
    assert row(one_row, "training", "logits").bytes == 25 * 8192 * local_vocab
    # a budget below one row still trains that row alone
    assert qwen3_4b(max_tokens_per_micro_batch=4096).micro_batch_tokens == 9216


SLIME_QWEN3_4B = (
    # scripts/models/qwen3-4B.sh and scripts/run-qwen3-4B.sh's flags for the plan (the whole script: tests/test_launch
    # docs); 8 GPUs as its ray job gives the actor
    "--swiglu --num-layers 36 --hidden-size 2560 --ffn-hidden-size 9728 --num-attention-heads 32 "
    "--group-query-attention --num-query-groups 8 --use-rotary-position-embeddings --disable-bias-linear "
    "--normalization RMSNorm --norm-epsilon 1e-6 --rotary-base 1000000 --vocab-size 151936 --kv-channels 128 "
    "--qk-layernorm --actor-num-nodes 1 --actor-num-gpus-per-node 8 --colocate --rollout-batch-size 32 "
    "--n-samples-per-prompt 8 --rollout-max-response-len 8192 --global-batch-size 256 "
    "--tensor-model-parallel-size 2 --recompute-granularity full --recompute-method uniform --recompute-num-layers 1 "
    "--use-dynamic-batch-size --max-tokens-per-gpu 9216 --rollout-num-gpus-per-engine 2 "
    "--sglang-mem-fraction-static 0.7 --bf16")


def launch(tmp_path, monkeypatch, flags: str, hf: str, *extra: str):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    cfg = parse_args([*shlex.split(flags), "--hf-checkpoint", str(HF / hf), "--save", str(tmp_path / "run"),
                      "--num-stages", "2", "--dry-run", *extra])
    return plan_memory(cfg.memory)


def test_slimes_qwen3_4b_fits_eight_h200(tmp_path, monkeypatch):
    plan = launch(tmp_path, monkeypatch, SLIME_QWEN3_4B, "Qwen3-4B")
    c = plan.config
    assert (c.tp, c.dp, c.server_tp, c.servers_per_gpu, c.mem_fraction_static) == (2, 4, 2, 1, 0.7)
    assert c.micro_batch_tokens == 9216 and c.release_during_training
    check_memory(plan)  # fits
    assert plan.total("training") / GIB < 45  # the trainer alone: the servers are released (below)
    # The report, from megamu before this plan: 8 rows x 9216 tokens (--micro-batch-size 8, the budget
    # ignored) needed 251.9 GiB in training
    eight_rows = plan_memory(replace(c, max_tokens_per_micro_batch=None, micro_batch_size=8))
    assert eight_rows.total("training") / GIB > H200_GIB


def test_colocated_servers_hold_nothing_while_the_trainer_trains_with_the_memory_saver(tmp_path, monkeypatch):
    saver = launch(tmp_path, monkeypatch, SLIME_QWEN3_4B, "Qwen3-4B")  # a CPU dry run, planned as a GPU run
    kv = row(saver, "training", "server: KV cache")
    assert not kv.counted and not row(saver, "training", "server: weights").counted
    held = launch(tmp_path, monkeypatch, SLIME_QWEN3_4B, "Qwen3-4B", "--no-sglang-memory-saver")
    assert row(held, "training", "server: KV cache").counted
    assert held.total("training") - saver.total("training") == kv.bytes + row(saver, "training", "server: w").bytes
    # the KV cache it holds while generating: 0.7 x (free at its start) - its weights
    ctx = 2 * GIB
    free = H200_GIB * GIB - ctx - ctx  # the trainer's context (its state offloaded) and the server's own
    assert row(saver, "rollout (colocated)", "server: KV cache").bytes == pytest.approx(0.7 * free - row(
        saver, "rollout (colocated)", "server: weights").bytes, abs=2)


# verl examples/grpo_trainer/run_qwen2-7b.sh as docs/coming-from-slime-verl.md translates it, with verl's own
# ppo_micro_batch_size_per_gpu=40 and no token budget
VERL_QWEN2_7B = (
    "--actor-num-nodes 1 --actor-num-gpus-per-node 8 --bf16 --algorithm grpo --loss-aggregation token-mean "
    "--rollout-batch-size 1024 --max-prompt-length 512 --rollout-max-response-len 1024 --prompts-per-update 256 "
    "--micro-batch-size 40 --recompute-granularity full --rollout-mode colocated --rollout-engine sglang "
    "--sglang-tp-size 2 --sglang-server-args '--mem-fraction-static 0.6' --n-samples-per-prompt 5")


def test_an_overflow_names_each_flag_that_alone_makes_it_fit(tmp_path, monkeypatch):
    base = VERL_QWEN2_7B.replace("--num-stages 105", "")
    plan = launch(tmp_path, monkeypatch, base, "Qwen2-7B-Instruct")
    with pytest.raises(SystemExit) as e:
        check_memory(plan)
    message = str(e.value)
    assert "phase 'training' needs" in message and "overflows at 'logits" in message
    fixes = dict(part.split(" ", 1) if " " in part else (part, "") for part in
                 message.split("Any one of these fits: ")[1].split("; "))
    assert set(fixes) >= {"--max-tokens-per-micro-batch", "--micro-batch-size"}
    for flag, value in fixes.items():  # each alone fits; one step more of a budget or a row does not
        check_memory(launch(tmp_path, monkeypatch, base, "Qwen2-7B-Instruct", flag, *value.split()))
    budget = int(fixes["--max-tokens-per-micro-batch"])
    more = launch(tmp_path, monkeypatch, base, "Qwen2-7B-Instruct", "--max-tokens-per-micro-batch", str(budget + 256))
    assert more.total("training") > H200_GIB * GIB
    rows = int(fixes["--micro-batch-size"])
    assert launch(tmp_path, monkeypatch, base.replace("--micro-batch-size 40", f"--micro-batch-size {rows + 1}"),
                  "Qwen2-7B-Instruct").total("training") > H200_GIB * GIB


def test_verls_qwen2_7b_recipe_as_translated_fits_eight_h200(tmp_path, monkeypatch):
    plan = launch(tmp_path, monkeypatch, VERL_QWEN2_7B, "Qwen2-7B-Instruct", "--max-tokens-per-micro-batch", "16384")
    assert (plan.config.tp, plan.config.dp, plan.config.server_tp) == (1, 8, 2)
    check_memory(plan)
