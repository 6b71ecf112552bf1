"""examples/: every run script builds a valid command whose dry-run plan has the paper's counts (App. B)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"
# Paper models and their context lengths (prompt + response): 4k for Qwen2.5-Math-7B, 8k otherwise (App. B).
MODELS = {"qwen2.5-math-7b": 4096, "deepseek-r1-distill-qwen-7b": 8192, "llama-3.2-3b-instruct": 8192,
          "qwen3-1.7b-base": 8192, "qwen3-8b-base": 8192}
METHODS = ["mu_grpo", "grpo", "grpo_high_staleness", "m2po"]
SCRIPTS = [(m, k) for m in MODELS for k in METHODS]
# The coding experiment (§5.1): μ-GRPO against GRPO only.
CODE_MODEL, CODE_METHODS = "qwen2.5-coder-7b", ["mu_grpo", "grpo"]


def _launch_argv(script: Path, tmp_path: Path, *extra: str, **env) -> tuple[dict, list[str]]:
    """Run the bash script with a stand-in interpreter that records (WORLD_SIZE, cwd, argv) instead of starting."""
    shim, out = tmp_path / "shim.sh", tmp_path / "argv.bin"
    shim.write_text('#!/usr/bin/env bash\nprintf "%s\\0" "${WORLD_SIZE:-}" "$PWD" "$@" > "$SHIM_OUT"\n')
    shim.chmod(0o755)
    full_env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "SGLANG_URL", "NNODES")}
    full_env.update(PYTHON=str(shim), TORCHRUN=str(shim), SHIM_OUT=str(out), **env)
    proc = subprocess.run(["bash", str(script), *extra], env=full_env, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    world, cwd, *argv = out.read_bytes().decode().split("\0")[:-1]
    return {"WORLD_SIZE": world, "cwd": cwd}, argv


def _dry_run_in_process(argv: list[str], world: str, monkeypatch, capsys):
    """What `python pretrain_mu_grpo.py <argv>` does in a dry run, in this process (one torch import for all)."""
    import pretrain_mu_grpo
    from megamu.arguments import parse_args

    monkeypatch.setenv("WORLD_SIZE", world)
    assert argv[0] == "pretrain_mu_grpo.py" and argv[-1] == "--dry-run"
    pretrain_mu_grpo.main(argv[1:])
    plan_line = capsys.readouterr().out.strip().splitlines()[-1]
    assert plan_line.startswith("plan: "), plan_line
    return json.loads(plan_line[len("plan: "):]), parse_args(argv[1:])


@pytest.mark.parametrize(("model", "method"), SCRIPTS, ids=[f"{m}/{k}" for m, k in SCRIPTS])
def test_example_dry_run_matches_paper(model, method, tmp_path, monkeypatch, capsys):
    script = EXAMPLES / model / f"run_{method}.sh"
    env, argv = _launch_argv(script, tmp_path, DRY_RUN="1")
    assert env == {"WORLD_SIZE": "4", "cwd": str(REPO)}  # 4xH200, run from the repo root
    plan, cfg = _dry_run_in_process(argv, env["WORLD_SIZE"], monkeypatch, capsys)
    opt, rollout, algo = cfg.policy.optimizer, cfg.rollout, cfg.algo

    # Same rollout-sample budget for every method: 4096 updates x 32 prompt groups x 8 samples.
    assert (plan["total_updates"], plan["prompts_per_update"], plan["n_samples_per_prompt"]) == (4096, 32, 8)
    assert plan["total_samples"] == 4096 * 32 * 8
    if method == "grpo":  # μ = 4: 1024 refreshes, engine kept alive, weights pushed in place
        assert (plan["num_stages"], plan["mu"], plan["weight_syncs"], plan["rollout_mode"]) == (1024, 4, 1024,
                                                                                               "colocated")
    else:  # μ = 1024 over 4 stages
        assert (plan["num_stages"], plan["updates_per_stage"], plan["weight_syncs"]) == (4, 1024, 4)
        assert plan["rollout_mode"] == "staged"
    expected_algo = {"mu_grpo": "mu-grpo", "grpo": "grpo", "grpo_high_staleness": "grpo-high-staleness",
                     "m2po": "m2po"}[method]
    assert plan["algorithm"] == expected_algo

    # App. B optimiser and sampling settings.
    assert (opt.lr, opt.lr_warmup_iters, opt.weight_decay, opt.adam_beta1, opt.adam_beta2) == (
        1e-6, 0, 0.01, 0.9, 0.999)
    assert (rollout.temperature, rollout.top_p) == (1.0, 1.0)
    assert cfg.prompts.max_prompt_length + rollout.max_new_tokens == MODELS[model]
    assert cfg.policy.bf16 and cfg.engine.kind == "sglang" and not cfg.recompute_behaviour_logprobs
    assert cfg.tensor_model_parallel_size in (1, 2, 4) and 4 % cfg.tensor_model_parallel_size == 0
    if method == "mu_grpo":  # relaxed clip [0, 5] and sequence-scope veto at τ = 1e-4
        assert (1 - algo.clip_low, 1 + algo.clip_high) == (0.0, 5.0)
        assert (algo.veto_threshold, algo.veto_scope) == (1e-4, "sequence")
    elif method == "m2po":
        assert algo.m2po_threshold == 0.04 and algo.veto_threshold is None
    else:  # GRPO, ε = 0.2, no veto
        assert (algo.clip_low, algo.clip_high, algo.veto_threshold) == (0.2, 0.2, None)


@pytest.mark.parametrize(("method", "lag", "algorithm"),
                         [("mu_grpo_async", 1024, "mu-grpo"), ("grpo_async", 4, "grpo")])
def test_async_examples_are_table_2(method, lag, algorithm, tmp_path, monkeypatch, capsys):
    """Table 2 / App. B: 4xH200 split 2 + 2, weights synced every 4 updates, max lag (1 + 255) x 4 or 1 x 4."""
    script = EXAMPLES / "qwen2.5-math-7b" / f"run_{method}.sh"
    env, argv = _launch_argv(script, tmp_path, DRY_RUN="1")
    assert env["WORLD_SIZE"] == "2"  # torchrun's trainer ranks: the two training GPUs
    plan, cfg = _dry_run_in_process(argv, env["WORLD_SIZE"], monkeypatch, capsys)
    assert (plan["rollout_mode"], plan["algorithm"], plan["max_policy_lag"]) == ("async", algorithm, lag)
    assert (plan["total_updates"], plan["prompts_per_update"], plan["n_samples_per_prompt"]) == (4096, 32, 8)
    assert plan["weight_sync_interval"] == 4 and plan["weight_syncs"] == 4095 // 4
    assert cfg.async_.rollout_devices == "2,3" and cfg.engine.sglang.num_servers == 2
    assert cfg.engine.kind == "sglang" and cfg.tensor_model_parallel_size == 2
    if method == "mu_grpo_async":
        assert (1 - cfg.algo.clip_low, 1 + cfg.algo.clip_high, cfg.algo.veto_threshold) == (0.0, 5.0, 1e-4)
    else:
        assert (cfg.algo.clip_low, cfg.algo.clip_high, cfg.algo.veto_threshold) == (0.2, 0.2, None)


def test_example_launch_uses_torchrun_and_overrides(tmp_path):
    script = EXAMPLES / "qwen3-1.7b-base" / "run_mu_grpo.sh"
    _, argv = _launch_argv(script, tmp_path, "--save-interval", "100", SAVE_DIR="/ckpt/x")
    assert argv[:3] == ["--nproc_per_node", "4", "pretrain_mu_grpo.py"] and "--dry-run" not in argv
    assert argv[argv.index("--save") + 1] == "/ckpt/x"
    # Extra arguments come last, so argparse lets them win over the script's own --save-interval.
    assert argv[-2:] == ["--save-interval", "100"] and argv.count("--save-interval") == 2
    # Multi-node: c10d rendezvous; trainer-started SGLang servers stay on rank 0's node (one per local GPU).
    _, argv = _launch_argv(script, tmp_path, NNODES="2", NODE_RANK="1", MASTER_ADDR="node0")
    assert argv[:8] == ["--nproc_per_node", "4", "--nnodes", "2", "--node_rank", "1", "--rdzv_backend", "c10d"]
    assert argv[argv.index("--rdzv_endpoint") + 1] == "node0:29500"
    assert argv[argv.index("--sglang-num-servers") + 1] == "4"
    _, argv = _launch_argv(script, tmp_path, SGLANG_URL="http://router:30000")
    assert argv[argv.index("--sglang-url") + 1] == "http://router:30000" and "--sglang-num-servers" not in argv


def test_example_real_dry_run_subprocess():
    """One script end to end with the real interpreter: no torchrun, no weights, the plan printed last."""
    env = {k: v for k, v in os.environ.items() if k != "WORLD_SIZE"}
    env.update(DRY_RUN="1", PYTHON=sys.executable)
    proc = subprocess.run(["bash", str(EXAMPLES / "qwen2.5-math-7b" / "run_mu_grpo.sh"), "--save-interval", "100"],
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    plan = json.loads(proc.stdout.strip().splitlines()[-1].removeprefix("plan: "))
    assert (plan["num_stages"], plan["mu"], plan["total_updates"]) == (4, 1024, 4096)
    # Qwen2.5-Math-7B: 4k context = 1024 prompt + 3072 response tokens, for every sample of a stage.
    assert plan["max_tokens_per_stage"] == 32768 * 8 * 3072


def test_cpu_demo_is_the_embedded_default(tmp_path):
    env, argv = _launch_argv(EXAMPLES / "cpu_demo" / "run.sh", tmp_path, DRY_RUN="1")
    assert argv == ["pretrain_mu_grpo.py", "--dry-run"] and env["cwd"] == str(REPO)
    env = {k: v for k, v in os.environ.items() if k != "WORLD_SIZE"}
    env.update(DRY_RUN="1", PYTHON=sys.executable)
    proc = subprocess.run(["bash", str(EXAMPLES / "cpu_demo" / "run.sh")], env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    plan = json.loads(proc.stdout.strip().splitlines()[-1].removeprefix("plan: "))
    assert plan["algorithm"] == "mu-grpo" and plan["num_stages"] >= 2  # the issue: at least 2 stages of μ-GRPO


@pytest.mark.parametrize("method", CODE_METHODS)
def test_code_example_dry_run_matches_paper(method, tmp_path, monkeypatch, capsys):
    """§5.1 / App. B.2: Qwen2.5-Coder-7B on code_contests, the main setup with B_mini = 16, 8k context, 4096 updates."""
    env, argv = _launch_argv(EXAMPLES / CODE_MODEL / f"run_{method}.sh", tmp_path, DRY_RUN="1")
    assert env == {"WORLD_SIZE": "4", "cwd": str(REPO)}
    plan, cfg = _dry_run_in_process(argv, env["WORLD_SIZE"], monkeypatch, capsys)
    assert (plan["total_updates"], plan["prompts_per_update"], plan["n_samples_per_prompt"]) == (4096, 16, 8)
    assert (plan["num_stages"], plan["mu"]) == ((4, 1024) if method == "mu_grpo" else (1024, 4))
    assert cfg.prompts.max_prompt_length + cfg.rollout.max_new_tokens == 8192
    assert (cfg.rollout.reward.kind, cfg.rollout.reward.code_mode, cfg.prompts.answer_key) == ("code", "all", "tests")
    assert cfg.prompts.files[0].endswith("code_contests.jsonl") and cfg.policy.optimizer.lr == 1e-6
    assert cfg.algo.name == {"mu_grpo": "mu-grpo", "grpo": "grpo"}[method]


def test_every_paper_model_has_all_scripts():
    folders = sorted(p.name for p in EXAMPLES.iterdir() if p.is_dir())
    assert folders == sorted([*MODELS, CODE_MODEL, "cpu_demo"])
    for method in CODE_METHODS:
        assert os.access(EXAMPLES / CODE_MODEL / f"run_{method}.sh", os.X_OK)
    for model in MODELS:
        for method in METHODS:
            assert os.access(EXAMPLES / model / f"run_{method}.sh", os.X_OK)
    readme = (EXAMPLES / "README.md").read_text()
    assert all(m in readme for m in [*MODELS, CODE_MODEL]) and "H200" in readme


# Qwen2.5-Math-7B's config.json (public): the numbers the memory plan reads.
QWEN25_MATH_7B = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 3584,
                  "intermediate_size": 18944, "num_hidden_layers": 28, "num_attention_heads": 28,
                  "num_key_value_heads": 4, "vocab_size": 152064, "max_position_embeddings": 4096,
                  "tie_word_embeddings": False, "rms_norm_eps": 1e-6, "rope_theta": 10000.0}


@pytest.mark.parametrize("method", ["mu_grpo", "grpo"])
def test_the_7b_examples_memory_plan_fits_an_h200_and_the_old_colocated_settings_do_not(method, tmp_path,
                                                                                         monkeypatch, capsys):
    model = tmp_path / "Qwen2.5-Math-7B"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(QWEN25_MATH_7B))
    env, argv = _launch_argv(EXAMPLES / "qwen2.5-math-7b" / f"run_{method}.sh", tmp_path, DRY_RUN="1",
                             HF_CHECKPOINT=str(model), HOST_MEMORY_GIB="2048")  # a node's RAM, not this machine's
    plan, cfg = _dry_run_in_process(argv, env["WORLD_SIZE"], monkeypatch, capsys)
    assert cfg.memory is not None and (cfg.memory.tp, cfg.memory.dp, cfg.memory.gpu_memory_gib) == (2, 2, 143771 / 1024)
    from megamu.memory.memory_plan import plan_memory

    memory = plan_memory(cfg.memory)
    memory.check()  # every phase fits
    assert {"training"} < set(memory.phases())
    if method == "grpo":  # the servers as they were: resident through training, 85% of what was free at launch
        old = [a for a in argv if a != "--sglang-memory-saver"][:-1] + ["--no-sglang-memory-saver", "--dry-run"]
        import pretrain_mu_grpo

        monkeypatch.setenv("WORLD_SIZE", env["WORLD_SIZE"])
        with pytest.raises(SystemExit, match=r"--gpu-memory-gib: .*'training'"):
            pretrain_mu_grpo.main(old[1:])
