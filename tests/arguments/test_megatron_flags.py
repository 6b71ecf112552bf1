"""Flags a Megatron-LM or slime launch script carries over: accepted at megamu's values, checked, or refused by name."""

from pathlib import Path

import pytest

from megamu.arguments import parse_args


def args(tmp_path, *extra):
    return ["--save", str(tmp_path / "run"), "--num-stages", "2", "--n-samples-per-prompt", "8", *extra]


def test_slime_rollout_batch_size_is_prompts_per_rollout(tmp_path):
    cfg = parse_args(args(tmp_path, "--rollout-batch-size", "32", "--prompts-per-update", "4"))
    assert (cfg.plan.prompts_per_stage, cfg.plan.mu) == (32, 8)  # slime: 32 prompts x 8 samples per rollout


def test_global_batch_size_sets_or_checks_samples_per_update(tmp_path):
    cfg = parse_args(args(tmp_path, "--rollout-batch-size", "32", "--global-batch-size", "64"))
    assert cfg.plan.prompts_per_update == 8  # 64 samples / G = 8
    assert parse_args(args(tmp_path, "--prompts-per-update", "4", "--global-batch-size", "32")).plan.mu == 16


def test_no_op_flags_at_their_values_change_nothing(tmp_path):
    plain = parse_args(args(tmp_path))
    same = parse_args(args(tmp_path, "--pipeline-model-parallel-size", "1", "--context-parallel-size", "1",
                           "--use-distributed-optimizer"))
    assert same == plain


def test_decode_batch_flag_has_its_own_name(tmp_path):
    assert parse_args(args(tmp_path, "--local-engine-batch-size", "48")).engine.max_batch_size == 48


def test_lr_decay_defaults_to_the_run_length(tmp_path):
    opt = parse_args(args(tmp_path, "--lr-decay-style", "cosine", "--min-lr", "1e-7", "--lr", "1e-6")).policy.optimizer
    assert (opt.lr_decay_style, opt.lr_decay_iters, opt.min_lr) == ("cosine", 32, 1e-7)  # 2 stages x μ = 16


@pytest.mark.parametrize("bad, message", [
    (["--pipeline-model-parallel-size", "2"], "--pipeline-model-parallel-size: megamu runs pipeline model parallel "
                                              "size 1 only"),
    (["--context-parallel-size", "2"], "--context-parallel-size"),
    (["--sequence-parallel"], "--sequence-parallel: needs --tensor-model-parallel-size > 1"),
    (["--prompts-per-update", "4", "--global-batch-size", "16"], "--global-batch-size: 16 samples per update "
                                                                  "contradicts --prompts-per-update 4"),
    (["--global-batch-size", "12"], "--global-batch-size: 12 samples is not a whole number of groups"),
    (["--rollout-batch-size", "32", "--prompts-per-stage", "64"], "--rollout-batch-size: 32 contradicts"),
    (["--lr-decay-style", "linear", "--lr-warmup-iters", "40"], "--lr-decay-iters"),
    (["--min-lr", "1"], "--min-lr"),
    (["--eval-interval", "6"], "--eval-interval: 6 is not a multiple of μ = 16"),
    (["--eval-prompt-data", "aime"], "--eval-prompt-data: expected NAME PATH pairs"),
    (["--n-samples-per-eval-prompt", "-1"], "--n-samples-per-eval-prompt"),
    (["--eval-temperature", "0"], "--eval-temperature"),
])
def test_what_megamu_cannot_honour_is_an_error_naming_the_flag(tmp_path, bad, message):
    with pytest.raises(SystemExit) as e:
        parse_args(args(tmp_path, *bad))
    assert message in str(e.value)


def test_async_mode_refuses_an_eval_interval(tmp_path):
    with pytest.raises(SystemExit, match="--eval-interval: async mode evaluates after its last update only"):
        parse_args(["--save", str(tmp_path / "run"), "--rollout-mode", "async", "--train-iters", "8",
                    "--weight-sync-interval", "4", "--max-policy-lag", "8", "--eval-interval", "4"])


def test_sequence_parallel_runs_with_tp_on_gpus_only(tmp_path, monkeypatch):
    """--sequence-parallel: megatron-core's SP (tests/model/test_sequence_parallel.py compares it with TP 1), on a
    GPU device with TP > 1; refused on CPU (its collectives allocate on CUDA) and at TP 1 (nothing to split over)."""
    from megamu.arguments import build_parser
    from megamu.runtime.device import Device

    monkeypatch.setenv("WORLD_SIZE", "2")
    hf = Path(__file__).parents[1] / "fixtures" / "hf" / "Qwen3-4B"  # a readable config: the memory plan is made
    sp = args(tmp_path, "--hf-checkpoint", str(hf), "--tensor-model-parallel-size", "2", "--sequence-parallel")
    gpu = parse_args(sp, device=Device("cuda"))
    assert gpu.policy.sequence_parallel and gpu.memory.sequence_parallel
    assert not parse_args(sp[:-1], device=Device("cuda")).policy.sequence_parallel
    with pytest.raises(SystemExit, match="--sequence-parallel: megatron-core runs sequence parallelism on CUDA only"):
        parse_args(sp, device=Device("cpu"))
    # a dry run on a machine without GPUs plans the GPU run (as for --expert-model-parallel-size)
    assert parse_args([*sp, "--dry-run"], device=Device("cpu")).policy.sequence_parallel
    with pytest.raises(SystemExit, match="--sequence-parallel: needs --tensor-model-parallel-size > 1"):
        parse_args(args(tmp_path, "--sequence-parallel"), device=Device("cuda"))
    help_text = " ".join(build_parser().format_help().split())
    assert "--sequence-parallel megatron-core's sequence parallelism" in help_text
    assert "needs --tensor-model-parallel-size > 1 and GPUs" in help_text
