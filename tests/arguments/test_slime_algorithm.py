"""slime's policy-loss and precision flags mean what they mean in slime (THUDM/slime at 624b824):

- ``--eps-clip`` (default 0.2) and ``--eps-clip-high`` (default: ``--eps-clip``) are the PPO clip range
  (slime/utils/arguments.py:899-900 and :1876-1877), ``--advantage-estimator grpo`` its GRPO (:941); slime's GRPO has no
  negative-advantage veto. A launch giving them without ``--algorithm`` runs megamu's grpo preset with that range.
- slime trains in bf16 unless told ``--fp16`` (slime/backends/megatron_utils/arguments.py:157, ``args.bf16 = not
  args.fp16``).

The flags below are ``scripts/run-qwen3-30B-A3B.sh``'s GRPO_ARGS (lines 81-89) as written; the model is the dense
Qwen3-4B (tests/fixtures/hf), whose launch reads the same GRPO_ARGS (``scripts/run-qwen3-4B.sh``)."""

from pathlib import Path

import pytest

from megamu.arguments import parse_args

HF = Path(__file__).parents[1] / "fixtures" / "hf"
GRPO_ARGS = ["--advantage-estimator", "grpo", "--use-kl-loss", "--kl-loss-coef", "0.00", "--kl-loss-type",
             "low_var_kl", "--entropy-coef", "0.00", "--eps-clip", "0.2", "--eps-clip-high", "0.28"]
CLUSTER = ["--actor-num-nodes", "1", "--actor-num-gpus-per-node", "8", "--colocate"]


def dry_run(tmp_path, monkeypatch, *flags):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    return parse_args(["--save", str(tmp_path / "run"), "--hf-checkpoint", str(HF / "Qwen3-4B"), "--num-stages", "2",
                       "--dry-run", *CLUSTER, *flags])


def test_slimes_grpo_flags_without_algorithm_run_slimes_grpo_in_bf16(tmp_path, monkeypatch, capsys):
    run = dry_run(tmp_path, monkeypatch, *GRPO_ARGS)
    algo = run.algo
    assert (algo.name, algo.clip_low, algo.clip_high, algo.veto_threshold) == ("grpo", 0.2, 0.28, None)
    assert (algo.use_kl_loss, algo.kl_coef, algo.kl_type, algo.entropy_coef) == (True, 0.0, "low_var_kl", 0.0)
    assert run.policy.bf16 and run.engine.dtype == "bfloat16"
    out = capsys.readouterr().out
    how = [line for line in out.splitlines() if "-> --algorithm grpo" in line]
    assert len(how) == 1 and "slime's GRPO, ratio clipped to [0.8, 1.28], no negative-advantage veto" in how[0]
    assert "For μ-GRPO (relaxed clip [0, 5] and the veto): --algorithm mu-grpo" in how[0]
    assert "note: precision: bf16, as slime trains unless told --fp16" in out
    assert "warning:" not in out


def test_the_same_launch_with_algorithm_mu_grpo_runs_mu_grpo_and_warns_that_slimes_clip_is_not_applied(
        tmp_path, monkeypatch, capsys):
    run = dry_run(tmp_path, monkeypatch, *GRPO_ARGS, "--algorithm", "mu-grpo")
    algo = run.algo
    assert (algo.name, algo.veto_threshold, algo.veto_scope) == ("mu-grpo", 1e-4, "sequence")
    assert (algo.clip_low, algo.clip_high) == (1.0, 4.0)  # the paper's [0, 5] (§3.1), not slime's [0.8, 1.28]
    out = capsys.readouterr().out
    assert "warning: --eps-clip 0.2 --eps-clip-high 0.28 (slime's GRPO clip) not applied: μ-GRPO keeps its relaxed " \
           "clip [0, 5]" in out
    assert "-> --algorithm grpo" not in out
    # megamu's own clip flags do replace it, said as loudly
    algo = dry_run(tmp_path, monkeypatch, *GRPO_ARGS[:-4], "--algorithm", "mu-grpo", "--clip-high", "0.28").algo
    assert (algo.clip_low, algo.clip_high) == (1.0, 0.28)
    assert "warning: --clip-low/--clip-high replace μ-GRPO's relaxed clip [0, 5] by [0, 1.28]" \
        in capsys.readouterr().out


def test_mu_grpo_without_slimes_clip_is_the_papers(tmp_path, monkeypatch, capsys):
    grpo_args = GRPO_ARGS[:-4]  # GRPO_ARGS without --eps-clip 0.2 --eps-clip-high 0.28
    algo = dry_run(tmp_path, monkeypatch, *grpo_args, "--algorithm", "mu-grpo").algo
    assert (algo.name, algo.clip_low, algo.clip_high, algo.veto_threshold) == ("mu-grpo", 1.0, 4.0, 1e-4)
    assert "warning:" not in capsys.readouterr().out
    # --advantage-estimator grpo alone: slime's GRPO at slime's default clip 0.2 (both sides)
    algo = dry_run(tmp_path, monkeypatch, *grpo_args).algo
    assert (algo.name, algo.clip_low, algo.clip_high, algo.veto_threshold) == ("grpo", 0.2, 0.2, None)


def test_eps_clip_alone_sets_both_sides_as_in_slime(tmp_path, monkeypatch):
    algo = dry_run(tmp_path, monkeypatch, "--eps-clip", "0.3").algo
    assert (algo.name, algo.clip_low, algo.clip_high) == ("grpo", 0.3, 0.3)
    # megamu's own names keep megamu's meaning: one side each, on the default μ-GRPO
    algo = parse_args(["--save", str(tmp_path / "own"), "--num-stages", "2", "--clip-low", "0.3"]).algo
    assert (algo.name, algo.clip_low, algo.clip_high) == ("mu-grpo", 0.3, 4.0)


def test_a_clip_given_twice_with_two_values_is_refused(tmp_path, monkeypatch):
    with pytest.raises(SystemExit, match="--eps-clip: contradicts --clip-low 0.1"):
        dry_run(tmp_path, monkeypatch, "--eps-clip", "0.2", "--clip-low", "0.1")


def test_fp16_is_refused_by_name(tmp_path, monkeypatch):
    with pytest.raises(SystemExit, match="--fp16: megamu trains in bf16"):
        dry_run(tmp_path, monkeypatch, *GRPO_ARGS, "--fp16")


def test_a_slime_launch_run_on_cpu_trains_in_fp32_and_megamus_own_gpu_plan_says_fp32(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    cpu = parse_args(["--save", str(tmp_path / "cpu"), "--num-rollout", "2", "--advantage-estimator", "grpo"])
    assert not cpu.policy.bf16 and cpu.algo.name == "grpo"
    capsys.readouterr()
    plan = parse_args(["--save", str(tmp_path / "gpu"), "--hf-checkpoint", str(HF / "Qwen3-4B"), "--num-stages", "2",
                       "--dry-run", "--transformer-impl", "transformer_engine"])
    assert not plan.policy.bf16 and plan.algo.name == "mu-grpo"
    assert "note: precision: fp32 (megamu's default, engine float32 too); slime and verl train in bf16: --bf16" \
        in capsys.readouterr().out
