"""End to end: `pretrain_mu_grpo.py` on a tiny random model with the in-process engine (issue: the staged trainer).
The tiny model and the reference run are tests/e2e/conftest.py's."""

import json
import re
from pathlib import Path

import pytest
import torch

from megamu.arguments import parse_args
from tests.e2e.runs import MU, STAGES, final_weights, flags, launch, records

slow = pytest.mark.slow


@pytest.fixture(scope="module")
def colocated_grpo(tiny, tmp_path_factory) -> Path:
    """Standard GRPO, colocated (engine kept alive, weights pushed in memory), a checkpoint every 3 updates and none
    pruned: read by the preset test (grpo) and the colocated checkpoint test, which used to launch it apart."""
    save = tmp_path_factory.mktemp("runs") / "colocated-grpo"
    launch(flags(tiny, save, "--algorithm", "grpo", "--rollout-mode", "colocated", "--save-interval", "3",
                 "--keep-checkpoints", "0"))
    return save


@slow
def test_uninterrupted_run_writes_everything(tiny, reference):
    # after the first update, the rest of the run is estimated from this stage's rollout, that update and the base
    # evaluation: 7 more updates, 1 more stage's rollout, the final evaluation
    stdout = (reference.parent / "stdout.txt").read_text()
    eta = re.findall(r"\[eta\] about [\d.]+ min more for the run on this machine: (\d+) updates at ~[\d.]+s, "
                     r"(\d+) more rollout\(s\) at ~\d+s \(this stage's\), a final evaluation at", stdout)
    assert eta == [(str(STAGES * MU - 1), str(STAGES - 1))]
    updates = records(reference, "update")
    assert [u["update"] for u in updates] == list(range(STAGES * MU))
    for u in updates:
        for key in ("loss", "ratio_mean", "approx_kl", "clip_fraction", "veto_token_fraction", "ratio_neg_adv_mean",
                    "reward_mean", "entropy", "grad_norm", "lr", "tokens_per_s"):
            assert key in u, key
    # θ = β at each stage's first update: model, converter and engine agree on every behaviour log-prob
    for first in (updates[0], updates[MU]):
        assert first["ratio_mean"] == pytest.approx(1.0, abs=1e-4)
        assert first["approx_kl"] == pytest.approx(0.0, abs=1e-6)
    stages = records(reference, "stage")
    assert [s["stage"] for s in stages] == list(range(STAGES))
    assert all(s["t_rollout"] > 0 and s["t_train"] > 0 for s in stages)
    for s in stages:  # each stage's drift, from its μ updates' records (every update is logged here)
        kl = sorted(u["approx_kl"] for u in updates[s["stage"] * MU:(s["stage"] + 1) * MU])
        assert s["drift_updates"] == MU == 4 and s["approx_kl_max"] == kl[-1]
        assert s["approx_kl_median"] == pytest.approx((kl[1] + kl[2]) / 2, rel=1e-12)
    assert len(re.findall(r"\[stage \d\] rollout reward .* drift: KL median [\d.]+ \(max [\d.]+\), veto", stdout)) \
        == STAGES
    assert len(records(reference, "run")) == 1
    assert (reference / "latest_checkpointed_iteration.txt").read_text().strip() == str(STAGES * MU)
    for k in range(STAGES):
        assert (reference / "rollouts" / f"stage_{k}" / "manifest.json").exists()
    # stage exports go once their rollout is durable; the final one stays
    assert sorted(p.name for p in (reference / "hf").iterdir()) == ["final"]
    # --keep-checkpoints 2 (default) of the 4 written (--save-interval 2, μ = 4, 2 stages)
    assert sorted(p.name for p in reference.glob("iter_*")) == ["iter_0000006", "iter_0000008"]
    assert list((reference / "tensorboard").glob("events.*"))
    # the exported policy loads in transformers and differs from the initial one (training moved it)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(reference / "hf" / "final")
    init = AutoModelForCausalLM.from_pretrained(tiny)
    moved = [not torch.equal(a, b) for a, b in zip(model.parameters(), init.parameters())]
    assert any(moved)


# One run killed at each point in turn, each rerun resuming from what the kill before left (these were three tests of
# a kill and a resume each; one chain launches 4 trainers instead of 6 and still resumes from every point).
CRASHES = [
    ("mid-rollout", "shard:1"),  # stage 0 has 4 shards
    ("mid-optimisation", "update:3"),  # last checkpoint at update 2
    ("between-stages", "stage:0"),
]


@slow
def test_kill_and_resume_is_bitwise_identical(tiny, reference, tmp_path):
    save = tmp_path / "run"
    for point, crash in CRASHES:
        crashed = launch(flags(tiny, save), env={"MEGAMU_CRASH_AFTER": crash}, check=False)
        assert crashed.returncode != 0, f"{point}: the crash hook did not fire"
        assert not (save / "hf" / "final").exists(), point
        # as a killed colocated run leaves its servers' launch folder (kept for restarts)
        left = save / "hf" / "stage_0"
        if not left.exists():
            left.mkdir(parents=True)
            (left / "config.json").write_text("{}")
    launch(flags(tiny, save))
    assert sorted(p.name for p in (save / "hf").iterdir()) == ["final"]  # no stage export outlives its run
    ref, got = final_weights(reference), final_weights(save)
    assert ref.keys() == got.keys()
    for name in ref:
        assert torch.equal(ref[name], got[name]), name
    assert [u["update"] for u in records(save, "update")] == list(range(STAGES * MU))


@slow
@pytest.mark.parametrize(
    "tp, mode", [(2, "staged"), (2, "colocated"), (1, "staged")], ids=["tp2", "tp2-colocated", "dp2"]
)
def test_two_ranks(tiny, reference, tmp_path, tp, mode):
    save = tmp_path / "two-ranks"
    launch(flags(tiny, save, "--tensor-model-parallel-size", str(tp), "--rollout-mode", mode), nproc=2)
    updates = records(save, "update")
    assert len(updates) == STAGES * MU
    assert updates[0]["ratio_mean"] == pytest.approx(1.0, abs=1e-4)
    assert updates[MU]["ratio_mean"] == pytest.approx(1.0, abs=1e-4)  # colocated: the TP-gathered in-memory push
    # same weights and data at the first update: two ranks reproduce one rank's loss
    assert updates[0]["loss"] == pytest.approx(records(reference, "update")[0]["loss"], abs=1e-5)
    assert (save / "hf" / "final" / "config.json").exists()


@slow
@pytest.mark.parametrize("preset", ["mu-grpo", "grpo", "grpo-high-staleness", "grpo-relaxed", "m2po"])
def test_every_preset_runs_a_stage(tiny, tmp_path, preset, request):
    if preset == "mu-grpo":  # the default algorithm: the reference run is it
        save = request.getfixturevalue("reference")
    elif preset == "grpo":  # the standard-GRPO baseline: engine kept alive, weights pushed in memory
        save = request.getfixturevalue("colocated_grpo")
    else:
        save = tmp_path / preset
        launch(flags(tiny, save, "--algorithm", preset, "--num-stages", "1", "--eval-prompts", "0"))
    updates = records(save, "update")
    assert updates and all(u["loss"] is not None for u in updates)
    assert updates[0]["ratio_mean"] == pytest.approx(1.0, abs=1e-4)
    if preset == "grpo":
        assert updates[MU]["ratio_mean"] == pytest.approx(1.0, abs=1e-4)  # the in-memory push reached the engine
    if preset in ("grpo-relaxed", "grpo", "grpo-high-staleness"):
        assert all(u["veto_token_fraction"] == 0.0 for u in updates)
    if preset != "m2po":
        assert all(u["m2po_mask_fraction"] == 0.0 for u in updates)


@slow
def test_skipping_zero_advantage_samples_end_to_end(tiny, tmp_path):
    save = tmp_path / "skip"
    launch(flags(tiny, save, "--num-stages", "1", "--eval-prompts", "0", "--skip-zero-advantage"))
    updates = records(save, "update")
    assert len(updates) == MU and all(u["loss"] is not None for u in updates)
    trained = [u for u in updates if u["trained_sample_fraction"] > 0]
    assert all(u["ratio_mean"] is None for u in updates if u["trained_sample_fraction"] == 0)
    assert trained and trained[0]["ratio_mean"] == pytest.approx(1.0, abs=1e-2)  # θ moved little since update 0


@slow
def test_dry_run_prints_plan_and_starts_nothing(tiny, tmp_path):
    save = tmp_path / "dry"
    proc = launch(flags(tiny, save, "--dry-run", "--mu", "4"))
    plan = json.loads(proc.stdout.strip().splitlines()[-1].removeprefix("plan: "))
    assert plan["total_updates"] == STAGES * MU and plan["samples_per_stage"] == 32 and plan["weight_syncs"] == STAGES
    assert not save.exists()


@pytest.mark.parametrize(
    "bad, flag",
    [
        (["--mu", "3"], "--mu"),  # 8 prompts per stage, 2 per update: μ = 4
        (["--n-samples-per-prompt", "1"], "--n-samples-per-prompt"),
        (["--prompts-per-update", "3"], "--prompts-per-update"),
        (["--nav-threshold", "2"], "--nav-threshold"),
        (["--lr", "0"], "--lr"),
        (["--reward-fn", "nocolon"], "--reward-fn"),
        (["--algorithm", "ppo"], "--algorithm"),
        (["--rollout-max-response-len", "512"], "--rollout-max-response-len: 512 leaves no room"),
        (["--hf-checkpoint", "/nonexistent/model"], "--hf-checkpoint"),
    ],
)
def test_bad_flags_name_the_flag(tiny, tmp_path, bad, flag, capsys):
    with pytest.raises(SystemExit) as e:
        parse_args(flags(tiny, tmp_path / "bad", *bad))
    assert flag in str(e.value) + capsys.readouterr().err
    assert not (tmp_path / "bad").exists()


def test_missing_prompt_file_is_a_clear_error(tiny, tmp_path):
    with pytest.raises(SystemExit, match="--prompt-data: .*nope.jsonl"):
        parse_args(flags(tiny, tmp_path / "x", "--prompt-data", str(tmp_path / "nope.jsonl")))


def test_stage_prompts_cover_each_epoch_once():
    from megamu.data.order import epoch_stream

    n, per_stage = 10, 4  # 2.5 stages per epoch: stage 2 straddles epochs 0 and 1
    stream = [i for k in range(5) for i in epoch_stream(n, 3, k * per_stage, per_stage)]
    assert sorted(stream[:n]) == list(range(n)) and sorted(stream[n : 2 * n]) == list(range(n))
    assert stream[:n] != stream[n : 2 * n]  # reshuffled each epoch
    assert epoch_stream(n, 3, 3 * per_stage, per_stage) == stream[12:16]  # a stage is a pure function of its index


@slow
def test_offload_train_is_bitwise_and_frees_the_optimiser_state(tiny, reference, tmp_path):
    """Staged runs offload by default (the reference): the same run without it ends with the same weights, bit for
    bit, and each stage record shows the trainer holding at least the Adam moments less while the engine ran."""
    save = tmp_path / "no-offload"
    launch(flags(tiny, save, "--no-offload-train"))
    ref, got = final_weights(reference), final_weights(save)
    assert ref.keys() == got.keys() and all(torch.equal(ref[n], got[n]) for n in ref)
    n_params = sum(t.numel() for t in ref.values())
    moments_gib = 2 * 4 * n_params / 2**30  # exp_avg + exp_avg_sq in fp32 (megatron's vocab padding only adds)
    for s in records(reference, "stage"):
        assert s["trainer_mem_train_gib"] - s["trainer_mem_rollout_gib"] >= moments_gib, s
    for s in records(save, "stage"):  # without the hand-off the moments stay (from stage 1 on: they exist)
        if s["stage"] > 0:
            assert s["trainer_mem_train_gib"] - s["trainer_mem_rollout_gib"] < moments_gib, s
    assert not (reference / "offload").exists() or not any((reference / "offload").iterdir())  # spill files gone


@slow
def test_retention_keeps_two_checkpoints_and_resumes_bitwise(tiny, reference, tmp_path):
    """A checkpoint after every update, 2 kept: a kill mid-stage-1 and a resume end bitwise equal to the uninterrupted
    reference run (checkpoints are read only on a resume, so how often they are written changes no weight), with
    exactly 2 checkpoints on disk."""
    killed = tmp_path / "killed"
    every = ("--save-interval", "1", "--keep-checkpoints", "2")
    crashed = launch(flags(tiny, killed, *every), env={"MEGAMU_CRASH_AFTER": "update:6"}, check=False)
    assert crashed.returncode != 0
    assert sorted(p.name for p in killed.glob("iter_*")) == ["iter_0000005", "iter_0000006"]
    launch(flags(tiny, killed, *every))
    ref, got = final_weights(reference), final_weights(killed)
    assert ref.keys() == got.keys() and all(torch.equal(ref[n], got[n]) for n in ref)
    assert sorted(p.name for p in killed.glob("iter_*")) == ["iter_0000007", "iter_0000008"]
    assert not list(killed.glob(".iter_*"))
    disk = sum(f.stat().st_size for f in killed.glob("iter_*/**/*") if f.is_file())
    print(f"2 checkpoints: {disk / 2**20:.2f} MiB")


@slow
def test_colocated_run_writes_no_per_refresh_checkpoint_or_export(colocated_grpo):
    # 2 refreshes of μ = 4 updates: a checkpoint every 3 updates of the run and at its end, none at a refresh (4)
    assert len(records(colocated_grpo, "update")) == 8
    assert sorted(p.name for p in colocated_grpo.glob("iter_*")) == [f"iter_{i:07d}" for i in (3, 6, 8)]
    assert sorted(p.name for p in (colocated_grpo / "hf").iterdir()) == ["final"]
