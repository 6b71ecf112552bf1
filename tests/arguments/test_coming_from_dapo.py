"""docs/coming-from-slime-verl.md's verl DAPO section stays true: the recipe's 70 keys (verl-recipe 48ea0a7,
dapo/run_dapo_qwen2.5_32b.sh, shell variables expanded) each have their row, and the megamu launch, dry-run on
Qwen2.5-32B's public config for its 16 x 8 GPUs, resolves every setting the recipe gives to the recipe's value."""

import re

import pytest

from megamu.arguments import parse_args
from tests.arguments.test_coming_from import HF, PAGE, after, blocks, phase_totals, words

NAME = "verl Qwen2.5-32B DAPO"
PREFIX = "actor_rollout_ref."  # left off in the page's rows


def recipe() -> dict[str, str]:
    """The recipe's key=value overrides, in order, the common prefix left off."""
    argv = after(words(blocks()["source 3"]), "recipe.dapo.main_dapo")
    return {k.removeprefix(PREFIX): v for k, v in (w.split("=", 1) for w in argv)}


def value(text: str):
    """A Hydra override's value as verl reads it: True/False, an int, a float, else the string."""
    if text in ("True", "False"):
        return text == "True"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def launch(tmp_path, monkeypatch) -> list[str]:
    argv = words(blocks()[NAME])
    launcher = argv[:argv.index("pretrain_mu_grpo.py")]
    per_node = int(launcher[launcher.index("--nproc_per_node") + 1])
    nodes = int(launcher[launcher.index("--nnodes") + 1])
    monkeypatch.setenv("WORLD_SIZE", str(per_node * nodes))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(per_node))
    monkeypatch.setenv("RANK", "0")
    flags = after(argv, "pretrain_mu_grpo.py")
    flags[flags.index("--hf-checkpoint") + 1] = str(HF / "Qwen2.5-32B")
    flags[flags.index("--save") + 1] = str(tmp_path / "save")
    return [*flags, "--dry-run"]


def test_every_key_of_the_recipe_has_its_row():
    keys = recipe()
    assert len(keys) == 70
    table = PAGE.read_text().split("| verl key (DAPO recipe) | megamu |")[1]
    rows = [line.split(" | ")[0] for line in table.splitlines() if line.startswith("| `")]
    assert len(rows) == 70
    missing = [k for k in keys if not any(re.search(rf"`{re.escape(k)}[`=]", row) for row in rows)]
    assert not missing, missing


# recipe key -> the resolved setting that must equal the recipe's value (with its conversion where the units differ)
RESOLVED = {
    "data.prompt_key": lambda r: r.prompts.prompt_key,
    "data.max_prompt_length": lambda r: r.prompts.max_prompt_length,
    "data.max_response_length": lambda r: r.plan.max_response_len,
    "data.gen_batch_size": lambda r: r.algo.sampling_round_prompts,
    "data.train_batch_size": lambda r: r.plan.prompts_per_stage,
    "rollout.n": lambda r: r.plan.n_samples_per_prompt,
    "actor.use_kl_loss": lambda r: r.algo.use_kl_loss,
    "actor.kl_loss_coef": lambda r: r.algo.kl_coef,
    "actor.clip_ratio_low": lambda r: r.algo.clip_low,
    "actor.clip_ratio_high": lambda r: r.algo.clip_high,
    "actor.clip_ratio_c": lambda r: r.algo.clip_ratio_c,
    "algorithm.filter_groups.enable": lambda r: r.algo.dynamic_sampling,
    "algorithm.filter_groups.max_num_gen_batches": lambda r: r.algo.max_sampling_rounds,
    "algorithm.filter_groups.metric": lambda r: r.algo.filter_metric,
    "actor.ppo_max_token_len_per_gpu": lambda r: r.policy.max_tokens_per_micro_batch,
    "model.enable_gradient_checkpointing": lambda r: r.policy.recompute_granularity == "full",
    "actor.optim.lr": lambda r: r.policy.optimizer.lr,
    "actor.optim.lr_warmup_steps": lambda r: r.policy.optimizer.lr_warmup_iters / r.plan.mu,  # updates -> rollouts
    "actor.optim.weight_decay": lambda r: r.policy.optimizer.weight_decay,
    "actor.ppo_mini_batch_size": lambda r: r.plan.prompts_per_update,
    "actor.fsdp_config.param_offload": lambda r: r.policy.offload_train,
    "actor.fsdp_config.optimizer_offload": lambda r: r.policy.offload_train,
    "actor.entropy_coeff": lambda r: r.algo.entropy_coef,
    "actor.grad_clip": lambda r: r.policy.optimizer.clip_grad,
    "actor.loss_agg_mode": lambda r: r.algo.aggregation,
    "actor.ulysses_sequence_parallel_size": lambda r: r.tensor_model_parallel_size * r.policy.sequence_parallel,
    "rollout.gpu_memory_utilization":
        lambda r: float(r.engine.sglang.extra_server_args[r.engine.sglang.extra_server_args.index(
            "--mem-fraction-static") + 1]),
    "rollout.tensor_model_parallel_size": lambda r: r.engine.sglang.tp_size,
    "rollout.name": lambda r: "vllm" if r.engine.kind == "sglang" else r.engine.kind,  # megamu's engine for vLLM
    "rollout.temperature": lambda r: r.rollout.temperature,
    "rollout.top_p": lambda r: r.rollout.top_p,
    "rollout.val_kwargs.temperature": lambda r: r.evaluation.eval_temperature,
    "rollout.val_kwargs.top_p": lambda r: r.evaluation.eval_top_p,
    "rollout.val_kwargs.do_sample": lambda r: r.evaluation.eval_temperature > 0,
    "rollout.val_kwargs.n": lambda r: r.evaluation.n_samples_per_eval_prompt,
    "reward_model.overlong_buffer.enable": lambda r: bool(r.algo.overlong_buffer),
    "reward_model.overlong_buffer.len": lambda r: r.algo.overlong_buffer,
    "reward_model.overlong_buffer.penalty_factor": lambda r: r.algo.overlong_penalty_factor,
    "trainer.project_name": lambda r: r.tracker.project,
    "trainer.experiment_name": lambda r: r.tracker.name,
    "trainer.n_gpus_per_node": lambda r: r.ranks_per_node,
    "trainer.nnodes": lambda r: r.world_size // r.ranks_per_node,
    "trainer.test_freq": lambda r: r.evaluation.eval_interval / r.plan.mu,  # updates -> rollouts
    "trainer.save_freq": lambda r: r.save_interval / r.plan.mu,
}


def test_the_translated_launch_resolves_to_the_recipes_values(tmp_path, monkeypatch):
    keys = recipe()
    run = parse_args(launch(tmp_path, monkeypatch))
    got = {key: get(run) for key, get in RESOLVED.items()}
    want = {key: value(keys[key]) for key in RESOLVED}
    assert got == pytest.approx(want)
    # what the recipe leaves to verl's defaults or to the DAPO reward manager
    assert run.algo.name == "dapo" and run.algo.veto_threshold is None and run.policy.bf16
    assert run.plan.mu == 16 and run.rollout.reward.kind == "math" and run.rollout.reward.reward_fn is None
    assert run.tracker.wandb


def test_the_launch_fits_its_gpus_as_the_page_says(tmp_path, monkeypatch, capsys):
    import pretrain_mu_grpo

    pretrain_mu_grpo.main(launch(tmp_path, monkeypatch))
    out = capsys.readouterr().out
    assert "note: --lr-warmup-iters 10 rollouts -> 160 updates (μ = 16)" in out
    totals = phase_totals(out)
    assert all(t.endswith("fits") for t in totals.values()), totals
    training, rollout = totals["training"].split()[1], totals["rollout (colocated)"].split()[1]
    page = " ".join(PAGE.read_text().split())
    assert f"{float(training):.1f} GiB per GPU while training, {float(rollout):.1f} GiB during rollout" in page
    assert "TP 8 + SP x DP 16" in out


def test_lr_warmup_follows_the_interval_unit_except_in_a_slime_launch(tmp_path, monkeypatch):
    """verl's lr_warmup_steps counts rollouts (verl workers/fsdp_workers.py:921 steps the scheduler once per
    update_actor call); slime passes --lr-warmup-iters on as Megatron-LM's optimiser steps
    (slime/backends/megatron_utils/model.py:214: lr_warmup_iters x global_batch_size samples)."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    verl = ["--rollout-batch-size", "16", "--prompts-per-update", "4", "--num-stages", "2", "--lr-warmup-iters", "3"]
    run = parse_args(["--save", str(tmp_path / "v"), *verl, "--interval-unit", "rollouts"])
    assert (run.plan.mu, run.policy.optimizer.lr_warmup_iters) == (4, 12)
    assert parse_args(["--save", str(tmp_path / "u"), *verl, "--interval-unit", "updates"]).policy.optimizer \
        .lr_warmup_iters == 3
    slime = ["--rollout-batch-size", "16", "--global-batch-size", "32", "--num-rollout", "2", "--lr-warmup-iters", "3",
             "--save-interval", "2", "--interval-unit", "rollouts"]
    run = parse_args(["--save", str(tmp_path / "s"), *slime])
    assert (run.plan.mu, run.policy.optimizer.lr_warmup_iters, run.save_interval) == (4, 3, 8)


def test_the_overlong_buffer_switches_off_and_rounds_need_dynamic_sampling(tmp_path, monkeypatch):
    """verl's reward_model.overlong_buffer.enable=False: --overlong-buffer-len 0 (the dapo preset's 4096-token buffer
    cannot sit under a 12-token limit; switched off it need not)."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    short = ["--save", str(tmp_path / "d"), "--num-stages", "2", "--algorithm", "dapo", "--rollout-max-response-len",
             "12"]
    with pytest.raises(SystemExit, match="--overlong-buffer-len: 4096 tokens leaves no unpunished length"):
        parse_args(short)
    assert parse_args([*short, "--overlong-buffer-len", "0"]).algo.overlong_buffer == 0
    with pytest.raises(SystemExit, match="--prompts-per-sampling-round: sizes dynamic sampling's rounds"):
        parse_args(["--save", str(tmp_path / "g"), "--num-stages", "2", "--prompts-per-sampling-round", "32"])
    with pytest.raises(SystemExit, match="--prompts-per-sampling-round: 2 is fewer than the stage's 4 prompts"):
        parse_args([*short, "--overlong-buffer-len", "0", "--prompts-per-stage", "4", "--prompts-per-update", "2",
                    "--prompts-per-sampling-round", "2"])
