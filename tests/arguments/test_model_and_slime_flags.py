"""Megatron-LM's model arguments checked against the HF config, and slime's own flags translated to megamu's.

References: slime's ``scripts/models/qwen3-4B.sh`` and ``scripts/models/qwen2.5-7B.sh`` (THUDM/slime, the model flags
below, as written there) against the models' public config.json (tests/fixtures/hf); slime's meanings from
``slime/utils/arguments.py``; Megatron-LM's defaults for absent switches from ``megatron/training/arguments.py``.
"""

from pathlib import Path

import pytest

from megamu.arguments import parse_args

HF = Path(__file__).parents[1] / "fixtures" / "hf"
# slime scripts/models/qwen3-4B.sh, MODEL_ARGS as written
QWEN3_4B = ("--swiglu --num-layers 36 --hidden-size 2560 --ffn-hidden-size 9728 --num-attention-heads 32 "
            "--group-query-attention --num-query-groups 8 --use-rotary-position-embeddings --disable-bias-linear "
            "--normalization RMSNorm --norm-epsilon 1e-6 --rotary-base 1000000 --vocab-size 151936 --kv-channels 128 "
            "--qk-layernorm").split()
# slime scripts/models/qwen2.5-7B.sh (the same shape as Qwen2-7B-Instruct's config), MODEL_ARGS as written
QWEN2_7B = ("--swiglu --num-layers 28 --hidden-size 3584 --ffn-hidden-size 18944 --num-attention-heads 28 "
            "--group-query-attention --num-query-groups 4 --use-rotary-position-embeddings --disable-bias-linear "
            "--add-qkv-bias --normalization RMSNorm --norm-epsilon 1e-06 --rotary-base 1000000 --vocab-size 152064 "
            "--untie-embeddings-and-output-weights").split()


def run(tmp_path, model, *extra):
    return parse_args(["--save", str(tmp_path / "run"), "--hf-checkpoint", str(HF / model), "--num-stages", "2",
                       "--dry-run", *extra])


def refused(tmp_path, model, *extra) -> str:
    with pytest.raises(SystemExit) as e:
        run(tmp_path, model, *extra)
    return str(e.value)


@pytest.mark.parametrize("model, flags", [("Qwen3-4B", QWEN3_4B), ("Qwen2-7B-Instruct", QWEN2_7B)])
def test_slimes_model_flags_for_the_same_model_change_nothing(tmp_path, model, flags):
    assert run(tmp_path, model, *flags) == run(tmp_path, model)


@pytest.mark.parametrize("flag, value, hf", [
    ("--num-layers", "32", "num_hidden_layers = 36"),
    ("--hidden-size", "4096", "hidden_size = 2560"),
    ("--ffn-hidden-size", "8192", "intermediate_size = 9728"),
    ("--num-query-groups", "4", "num_key_value_heads = 8"),
    ("--kv-channels", "64", "head_dim = 128"),
    ("--rotary-base", "10000", "rope_theta = 1000000"),
    ("--norm-epsilon", "1e-5", "rms_norm_eps = 1e-06"),
    ("--vocab-size", "152064", "vocab_size = 151936"),
    ("--max-position-embeddings", "32768", "max_position_embeddings = 40960"),
])
def test_a_contradicting_model_flag_names_its_value_and_the_configs(tmp_path, flag, value, hf):
    flags = [f for i, f in enumerate(QWEN3_4B) if f != flag and (i == 0 or QWEN3_4B[i - 1] != flag)]
    message = refused(tmp_path, "Qwen3-4B", *flags, flag, value)
    shown = value if flag not in ("--rotary-base", "--norm-epsilon") else str(float(value))  # parsed as floats
    assert f"{flag}: {shown} contradicts" in message and hf in message


@pytest.mark.parametrize("model, add, drop, message", [
    # Qwen3-4B ties its embeddings (tie_word_embeddings true): slime's qwen3-4B.sh leaves the switch out
    ("Qwen3-4B", "--untie-embeddings-and-output-weights", None, "--untie-embeddings-and-output-weights: given"),
    ("Qwen3-4B", "--add-qkv-bias", None, "--add-qkv-bias: given"),
    # absent where the model has it: Megatron-LM would build without (its default)
    ("Qwen3-4B", None, "--qk-layernorm", "--qk-layernorm: absent (Megatron-LM then builds qk_layernorm=False)"),
    ("Qwen2-7B-Instruct", None, "--add-qkv-bias", "--add-qkv-bias: absent"),
    ("Qwen2-7B-Instruct", None, "--untie-embeddings-and-output-weights", "tie_word_embeddings = False"),
    ("Qwen3-4B", None, "--swiglu", "--swiglu: absent"),
    ("Qwen3-4B", None, "--use-rotary-position-embeddings", "--position-embedding-type: absent"),
])
def test_switches_are_read_as_megatron_lm_reads_them(tmp_path, model, add, drop, message):
    flags = [f for f in (QWEN3_4B if model == "Qwen3-4B" else QWEN2_7B) if f != drop] + ([add] if add else [])
    assert message in refused(tmp_path, model, *flags)


@pytest.mark.parametrize("flag, value, why", [
    ("--normalization", "LayerNorm", "RMSNorm"),
    ("--attention-dropout", "0.1", "without dropout"),
    ("--hidden-dropout", "0.1", "without dropout"),
    ("--position-embedding-type", "learned_absolute", "rotary"),
    ("--rotary-percent", "0.5", "whole head"),
])
def test_what_megamu_never_builds_is_refused_with_the_reason(tmp_path, flag, value, why):
    message = refused(tmp_path, "Qwen3-4B", flag, value)
    assert f"{flag}: {value} is not supported" in message and why in message


def test_dropout_zero_and_a_fitting_seq_length_are_accepted(tmp_path):
    plain = run(tmp_path, "Qwen3-4B")
    assert run(tmp_path, "Qwen3-4B", "--attention-dropout", "0.0", "--hidden-dropout", "0", "--seq-length",
               "9216") == plain
    assert "--seq-length: 50000 exceeds" in refused(tmp_path, "Qwen3-4B", "--seq-length", "50000")


def test_slimes_names_set_megamus_settings(tmp_path, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    cfg = run(tmp_path, "Qwen3-4B", "--rollout-batch-size", "32", "--n-samples-per-prompt", "8", "--global-batch-size",
              "64", "--colocate", "--rollout-num-gpus-per-engine", "2", "--actor-num-nodes", "1",
              "--actor-num-gpus-per-node", "2", "--tensor-model-parallel-size", "2",
              "--sglang-mem-fraction-static", "0.7", "--eps-clip", "0.2", "--eps-clip-high", "0.28",
              "--rm-type", "deepscaler", "--use-dynamic-batch-size", "--max-tokens-per-gpu", "9216",
              "--eval-max-response-len", "16384", "--rollout-engine", "sglang")
    assert cfg.plan.rollout_mode == "colocated" and cfg.plan.mu == 4  # 32 x 8 samples per rollout, 64 per update
    assert cfg.engine.kind == "sglang" and cfg.engine.sglang.tp_size == 2
    assert cfg.engine.sglang.extra_server_args == ["--mem-fraction-static", "0.7"]
    assert (cfg.algo.clip_low, cfg.algo.clip_high) == (0.2, 0.28)
    assert cfg.rollout.reward.reward_fn == "megamu.reward.math:deepscaler_score"
    # slime ignores --micro-batch-size with a dynamic batch: the token budget alone sizes micro-batches
    assert (cfg.policy.max_tokens_per_micro_batch, cfg.policy.micro_batch_size) == (9216, 64)
    assert cfg.evaluation.eval_max_response_len == 16384


def test_slimes_num_rollout_and_steps_per_rollout_are_stages_and_mu(tmp_path):
    cfg = parse_args(["--save", str(tmp_path / "run"), "--num-rollout", "5", "--num-steps-per-rollout", "4",
                      "--rollout-batch-size", "16"])
    assert (cfg.plan.num_stages, cfg.plan.mu, cfg.plan.prompts_per_update) == (5, 4, 4)


@pytest.mark.parametrize("bad, message", [
    (["--optimizer", "sgd"], "--optimizer: sgd is not supported"),
    (["--advantage-estimator", "gspo"], "--advantage-estimator: gspo is not supported"),
    (["--rm-type", "f1"], "--rm-type: f1 has no megamu equivalent"),
    (["--attention-backend", "fused"], "--attention-backend: fused is not supported"),
    (["--recompute-method", "block", "--recompute-granularity", "full"], "--recompute-method: block"),
    (["--recompute-method", "uniform"], "--recompute-method: uniform"),  # without full recompute
    (["--recompute-num-layers", "2"], "--recompute-num-layers: 2"),
    (["--max-tokens-per-gpu", "9216"], "--use-dynamic-batch-size: slime packs"),
    (["--use-dynamic-batch-size", "--max-tokens-per-gpu", "9216", "--micro-batch-size", "2"],
     "--micro-batch-size: slime ignores it"),
    (["--eval-input-key", "question"], "--eval-input-key: question differs from --input-key"),
    (["--colocate", "--rollout-mode", "staged"], "--colocate: contradicts --rollout-mode staged"),
    (["--num-rollout", "3", "--num-stages", "2"], "--num-rollout: contradicts --num-stages 2"),
    (["--rollout-num-gpus-per-engine", "2", "--sglang-tp-size", "4"], "--rollout-num-gpus-per-engine: contradicts"),
])
def test_slime_values_megamu_cannot_honour_name_megamus_equivalent(tmp_path, bad, message):
    with pytest.raises(SystemExit) as e:
        parse_args(["--save", str(tmp_path / "run"), "--num-stages", "2", *bad])
    assert message in str(e.value)


def test_expert_tensor_parallel_size_is_the_experts_own_and_must_fit_the_world(tmp_path, monkeypatch):
    """megatron-core's parallel folding (parallel_state.py:786-805): experts at ETP x EP x EDP over the same world as
    the dense TP x DP; ETP = TP unless given. Qwen3-30B-A3B's real config (tests/fixtures/hf)."""
    monkeypatch.setenv("WORLD_SIZE", "4")
    model = "Qwen3-30B-A3B"
    cfg = run(tmp_path, model, "--tensor-model-parallel-size", "2", "--sequence-parallel",
              "--expert-model-parallel-size", "2", "--expert-tensor-parallel-size", "1", "--bf16")
    layout = (cfg.tensor_model_parallel_size, cfg.expert_model_parallel_size, cfg.expert_tensor_parallel_size)
    assert layout == (2, 2, 1)
    assert (cfg.memory.tp, cfg.memory.dp, cfg.memory.ep, cfg.memory.expert_tp, cfg.memory.expert_dp) == (2, 2, 2, 1, 2)
    # TP 2 x EP 4 = 8 does not divide 4 ranks, but ETP 1 x EP 4 does: the experts fold over the TP ranks
    cfg = run(tmp_path, model, "--tensor-model-parallel-size", "2", "--sequence-parallel",
              "--expert-model-parallel-size", "4", "--expert-tensor-parallel-size", "1", "--bf16")
    assert cfg.memory.expert_dp == 1
    assert "--expert-model-parallel-size: ETP x EP = 2 x 4 = 8 does not divide world size 4 (ETP is " \
           "--tensor-model-parallel-size 2 unless" in refused(
               tmp_path, model, "--tensor-model-parallel-size", "2", "--sequence-parallel",
               "--expert-model-parallel-size", "4", "--bf16")
    assert "--expert-tensor-parallel-size: ETP x EP = 4 x 2 = 8 does not divide world size 4" in refused(
        tmp_path, model, "--expert-model-parallel-size", "2", "--expert-tensor-parallel-size", "4", "--bf16")


def test_actor_layout_is_the_dry_runs_world_and_checked_under_torchrun(tmp_path, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    base = ["--actor-num-nodes", "1", "--actor-num-gpus-per-node", "8", "--tensor-model-parallel-size", "2"]
    cfg = run(tmp_path, "Qwen3-4B", *base, "--bf16")
    assert (cfg.memory.tp, cfg.memory.dp) == (2, 4)
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert "= 8 GPUs contradicts torchrun's world of 4" in refused(tmp_path, "Qwen3-4B", *base)


def test_deepscaler_reward_grades_the_text_after_thinking_only():
    """slime rm_hub/deepscaler.py: the solution after the last </think> (else after ###Response); neither: 0."""
    from megamu.reward.math import deepscaler_score

    assert deepscaler_score("<think>maybe \\boxed{3}</think> so \\boxed{4}", "4") == 1.0
    assert deepscaler_score("<think>\\boxed{4}</think> so \\boxed{3}", "4") == 0.0
    assert deepscaler_score("no thinking: \\boxed{4}", "4") == 0.0
    assert deepscaler_score("###Response the answer is \\boxed{4}", "4") == 1.0


def test_on_gpus_the_engine_is_sglang_and_its_servers_fill_the_node(tmp_path, monkeypatch, capsys):
    from megamu.runtime.device import Device

    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    base = ["--save", str(tmp_path / "run"), "--num-stages", "2", "--tensor-model-parallel-size", "2"]
    gpu = parse_args([*base, "--sglang-tp-size", "2"], device=Device("cuda"))
    assert gpu.engine.kind == "sglang" and (gpu.engine.sglang.num_servers, gpu.engine.sglang.tp_size) == (4, 2)
    assert "4 per node x --sglang-tp-size 2 = 8 of the node's 8 GPUs" in capsys.readouterr().out
    assert parse_args([*base, "--sglang-num-servers", "1"], device=Device("cuda")).engine.sglang.num_servers == 1
    assert parse_args([*base, "--rollout-engine", "local"], device=Device("cuda")).engine.kind == "local"
    assert parse_args(base, device=Device("cpu")).engine.kind == "local"  # no SGLang on a CPU machine
    with pytest.raises(SystemExit, match="--rollout-engine: SGLang settings are only used with the sglang engine"):
        parse_args([*base, "--sglang-tp-size", "2"], device=Device("cpu"))


def test_a_hub_id_is_read_from_the_local_hf_cache_only(tmp_path, monkeypatch, capsys):
    """huggingface_hub's cache layout (models--ORG--NAME/refs/main -> snapshots/<commit>/), written by hand: the id
    resolves to the snapshot folder; an id not there is an error saying how to fetch it (megamu never downloads)."""
    cache = tmp_path / "hub"
    snapshot = cache / "models--Qwen--Qwen3-4B" / "snapshots" / ("a" * 40)
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text((HF / "Qwen3-4B" / "config.json").read_text())
    (cache / "models--Qwen--Qwen3-4B" / "refs").mkdir()
    (cache / "models--Qwen--Qwen3-4B" / "refs" / "main").write_text("a" * 40)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants as constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    cfg = parse_args(["--save", str(tmp_path / "run"), "--hf-checkpoint", "Qwen/Qwen3-4B", "--num-stages", "2",
                      "--dry-run", *QWEN3_4B])  # the model flags checked against the cached config
    assert cfg.policy.hf_checkpoint == str(snapshot)
    with pytest.raises(SystemExit, match="--hf-checkpoint: Qwen/Qwen3-8B is neither a folder here nor in the local "
                                         "HF cache .*huggingface-cli download Qwen/Qwen3-8B"):
        parse_args(["--save", str(tmp_path / "run"), "--hf-checkpoint", "Qwen/Qwen3-8B", "--num-stages", "2"])


def test_moe_layer_freq_reads_both_of_megatron_lms_forms():
    """megatron-core turns an integer N into one MoE layer every N, from layer 0 (models/gpt/gpt_layer_specs.py:583-586,
    pinned below); a list expression is evaluated as Python by Megatron-LM, here read without eval."""
    import inspect

    from megatron.core.models.gpt import gpt_layer_specs

    from megamu.arguments.model_args import moe_layer_pattern

    source = inspect.getsource(gpt_layer_specs)
    assert "1 if (i % config.moe_layer_freq == 0) else 0 for i in range(config.num_layers)" in source
    assert moe_layer_pattern("2", 5) == [1, 0, 1, 0, 1]
    assert moe_layer_pattern("([1]*3+[0])*2", 8) == [1, 1, 1, 0, 1, 1, 1, 0]
    assert moe_layer_pattern("[1,1,1]", 3) == [1, 1, 1]
    for bad in ("[1,2,1]", "__import__('os')", "0", "[1]*2"):
        with pytest.raises(SystemExit, match="--moe-layer-freq"):
            moe_layer_pattern(bad, 3)


@pytest.mark.parametrize("flag, value, message", [
    ("--moe-layer-freq", "2", "--moe-layer-freq: 2 makes layers [1, 3, 5"),
    ("--moe-layer-freq", "[1]*47", "--moe-layer-freq: '[1]*47' must give one 0 or 1 per layer (48 layers)"),
    ("--moe-router-score-function", "sigmoid", "--moe-router-score-function: sigmoid contradicts"),
])
def test_moe_flags_that_contradict_the_config_are_refused(tmp_path, flag, value, message):
    assert message in refused(tmp_path, "Qwen3-30B-A3B", flag, value)


def test_moe_flags_that_agree_change_nothing_and_a_dense_model_ignores_them(tmp_path):
    assert run(tmp_path, "Qwen3-30B-A3B", "--moe-layer-freq", "[1]*48") == run(tmp_path, "Qwen3-30B-A3B")
    assert run(tmp_path, "Qwen3-4B", "--moe-layer-freq", "2", "--moe-router-score-function", "sigmoid") == \
        run(tmp_path, "Qwen3-4B")


def test_experts_at_their_own_tp_are_refused_on_a_cpu_run(tmp_path, monkeypatch):
    """As EP: the dispatchers gather over ETP x EP through a gather that allocates on CUDA (mappings.py:141)."""
    from megamu.runtime.device import Device
    from tests.tiny import save_tiny_model

    monkeypatch.setenv("WORLD_SIZE", "2")
    hf = save_tiny_model(tmp_path / "moe", "qwen3_moe", seed=1, vocab_size=300)
    with pytest.raises(SystemExit, match="--expert-tensor-parallel-size: 2 .TP 1.: megatron-core runs experts at "
                                         "their own TP on CUDA only"):
        parse_args(["--hf-checkpoint", str(hf), "--save", str(tmp_path / "run"), "--num-stages", "2",
                    "--expert-tensor-parallel-size", "2"], device=Device("cpu"))
