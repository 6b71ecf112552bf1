"""Checkpoint layout, kill-free resume (bitwise on CPU) and clear errors (TP resharding: test_parallel.py)."""

import json
import random
import re

import numpy as np
import pytest
import torch

from megamu.algo import ALGORITHM_PRESETS
from megamu.model import build_model
from megamu.training import (
    CheckpointError,
    OptimizerConfig,
    build_optimizer,
    compute_logprobs,
    load_checkpoint,
    save_checkpoint,
    train_step,
)
from tests.training.helpers import make_samples, set_behaviour, tiny_model

CFG = OptimizerConfig(lr=2e-3, lr_warmup_iters=3, weight_decay=0.1)
ALGO = ALGORITHM_PRESETS["mu-grpo"]


@pytest.fixture(scope="module")
def run(distributed, tmp_path_factory):
    """Two updates uninterrupted, with a checkpoint after the first; returns what a resume must reproduce."""
    root = tmp_path_factory.mktemp("ckpt")
    model, arch = tiny_model(root / "hf", family="qwen2", seed=3)  # untied embeddings and QKV bias
    samples = make_samples(3, 4, arch.vocab_size, seed=2)
    set_behaviour(samples, compute_logprobs(model, samples, micro_batch_size=4), noise=0.3)
    opt = build_optimizer(model, CFG)
    train_step(model, opt, samples, ALGO, micro_batch_size=4)
    torch.manual_seed(123)
    random.seed(5)
    np.random.seed(7)
    path = save_checkpoint(root / "save", 1, model, arch, opt, extra={"stage": 2, "update_offset": 9},
                           hf_source_dir=root / "hf")
    saved_embedding = model.embedding.word_embeddings.weight.detach().clone()
    rng_after_save = (torch.rand(3), random.random(), np.random.rand())
    second = train_step(model, opt, samples, ALGO, micro_batch_size=4)
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return dict(root=root, arch=arch, samples=samples, path=path, rng=rng_after_save, second=second, params=params,
                saved_embedding=saved_embedding)


def fresh(arch):
    torch.manual_seed(999)  # different random weights: everything must come from the checkpoint
    model = build_model(arch)
    return model, build_optimizer(model, CFG)


def test_layout_is_atomic_and_megatron_named(run):
    save = run["root"] / "save"
    assert run["path"] == save / "iter_0000001"
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == "1"
    assert sorted(p.name for p in save.iterdir()) == ["iter_0000001", "latest_checkpointed_iteration.txt"]
    # megatron-core's torch_dist layout, as Megatron-LM writes it, with megamu's run state beside it
    assert json.loads((run["path"] / "metadata.json").read_text())["sharded_backend"] == "torch_dist"
    assert (run["path"] / "common.pt").exists() and list(run["path"].glob("__0_*.distcp"))
    state = json.loads((run["path"] / "megamu_state.json").read_text())
    assert state["extra"] == {"stage": 2, "update_offset": 9} and state["optimizer"]["iteration"] == 1
    assert state["has_optimizer_state"] and state["tensor_model_parallel_size"] == 1


def test_tensors_on_disk_are_the_models_and_the_optimizers(run):
    """Read back with megatron-core's own metadata reader and torch's DCP loader, not megamu's code."""
    import torch.distributed.checkpoint as dcp
    from megatron.core import dist_checkpointing

    keys = dist_checkpointing.load_tensors_metadata(str(run["path"]))
    assert "decoder.layers.self_attention.linear_qkv.weight" in keys  # layers stacked on a leading axis
    assert "optimizer.state.exp_avg.embedding.word_embeddings.weight" in keys
    assert "optimizer.state.exp_avg_sq.output_layer.weight" in keys
    meta = dcp.FileSystemReader(str(run["path"])).read_metadata()
    emb = torch.empty(meta.state_dict_metadata["embedding.word_embeddings.weight"].size)
    dcp.load({"embedding.word_embeddings.weight": emb}, checkpoint_id=str(run["path"]), no_dist=True)
    assert torch.equal(emb, run["saved_embedding"])


def test_resume_gives_bitwise_identical_next_update(run):
    model, opt = fresh(run["arch"])
    extra = load_checkpoint(run["root"] / "save", model, run["arch"], opt)
    assert extra == {"stage": 2, "update_offset": 9, "iteration": 1}
    rng = (torch.rand(3), random.random(), np.random.rand())
    assert torch.equal(rng[0], run["rng"][0]) and rng[1:] == run["rng"][1:]
    second = train_step(model, opt, run["samples"], ALGO, micro_batch_size=4)
    for k in ("loss", "grad_norm", "lr", "clip_fraction", "ratio_mean"):
        assert second[k] == run["second"][k], k
    for n, p in model.named_parameters():
        assert torch.equal(p.detach(), run["params"][n]), n


def test_no_checkpoint_and_corrupt_checkpoints(run, tmp_path):
    model, opt = fresh(run["arch"])
    assert load_checkpoint(tmp_path / "empty", model, run["arch"], opt) is None
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(run["root"] / "save", broken)
    shards = sorted((broken / "iter_0000001").glob("*.distcp"))
    for shard in shards:
        shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(CheckpointError, match="iter_0000001"):
        load_checkpoint(broken, model, run["arch"], opt)
    (broken / "iter_0000001" / "megamu_state.json").write_text("{trunc")
    with pytest.raises(CheckpointError, match="megamu_state.json"):
        load_checkpoint(broken, model, run["arch"], opt)
    (broken / "latest_checkpointed_iteration.txt").write_text("oops")
    with pytest.raises(CheckpointError, match="latest_checkpointed_iteration.txt.*'oops'"):
        load_checkpoint(broken, model, run["arch"], opt)


def test_retention_keeps_newest_and_the_tracked_one(run, tmp_path):
    from megamu.training.checkpoint_dirs import TRACKER, prune_checkpoints

    model, opt = fresh(run["arch"])
    save = tmp_path / "save"
    for it in (1, 2, 3):
        save_checkpoint(save, it, model, run["arch"], opt, extra={}, keep=2)
    assert sorted(p.name for p in save.iterdir()) == ["iter_0000002", "iter_0000003", TRACKER]
    # leftovers of a killed save are swept; a tracker pointing at an older checkpoint protects it
    (save / ".iter_0000004.tmp-x").mkdir()
    (save / TRACKER).write_text("2\n")
    for it in (5, 6):
        (save / f"iter_{it:07d}").mkdir()
    deleted = prune_checkpoints(save, 2)
    assert sorted(p.name for p in deleted) == [".iter_0000004.tmp-x", "iter_0000003"]
    assert sorted(p.name for p in save.iterdir()) == ["iter_0000002", "iter_0000005", "iter_0000006", TRACKER]
    assert prune_checkpoints(save, 0) == []  # 0 keeps all


def test_failed_write_leaves_previous_checkpoint_untouched(run, tmp_path, monkeypatch):
    import megamu.training.checkpoint as ckpt

    model, opt = fresh(run["arch"])
    save = tmp_path / "save"
    save_checkpoint(save, 1, model, run["arch"], opt, extra={})
    before = sorted(p.name for p in save.iterdir())

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ckpt, "_write_sharded", disk_full)
    with pytest.raises(CheckpointError, match="rank 0: OSError.*No space left"):
        save_checkpoint(save, 2, model, run["arch"], opt, extra={})
    assert sorted(p.name for p in save.iterdir()) == before  # no temp folder, tracker still at 1
    model, opt = fresh(run["arch"])
    assert load_checkpoint(save, model, run["arch"], opt)["iteration"] == 1


def test_stage_export_goes_only_once_its_rollout_is_durable(tmp_path):
    from megamu.run.run_dir import RunDir

    run = RunDir(tmp_path)
    prune_stage_export = lambda: run.prune_stage_export(0)
    hf = tmp_path / "hf" / "stage_0"
    hf.mkdir(parents=True)
    (hf / "config.json").write_text("{}")
    manifest = tmp_path / "rollouts" / "stage_0" / "manifest.json"
    assert not prune_stage_export() and hf.exists()  # rollout not finished: the export may be needed
    manifest.parent.mkdir(parents=True)
    manifest.write_text("{}")
    (tmp_path / "hf" / ".stage_0.deleting-1").mkdir()  # left by a killed delete
    assert prune_stage_export()
    assert list((tmp_path / "hf").iterdir()) == []
    assert not prune_stage_export()  # idempotent on resume


def test_a_runs_start_prunes_the_exports_of_durable_stages(tmp_path):
    from megamu.run.run_dir import RunDir

    run = RunDir(tmp_path)
    for k in (0, 2, 3):
        run.stage_export(k).mkdir(parents=True)
    for k in (0, 1, 2):  # D_0..D_2 durable; stage 3's rollout not finished (a resume needs its export)
        run.stage_rollouts(k).mkdir(parents=True)
        (run.stage_rollouts(k) / "manifest.json").write_text("{}")
    run.final_export.mkdir()
    assert run.prune_done_stage_exports() == [0, 2]
    assert sorted(p.name for p in run.exports.iterdir()) == ["final", "stage_3"]


def test_iter_exports_fall_under_retention(tmp_path):
    from megamu.run.run_dir import RunDir

    run = RunDir(tmp_path)
    for n in (200, 400, 600, 1000):
        run.iter_export(n).mkdir(parents=True)
    run.final_export.mkdir()
    run.stage_export(3).mkdir()
    deleted = run.prune_iter_exports(keep=2)
    assert sorted(d.name for d in deleted) == ["iter_0000200", "iter_0000400"]  # by update count, oldest first
    assert sorted(d.name for d in (tmp_path / "hf").iterdir()) == ["final", "iter_0000600", "iter_0001000", "stage_3"]
    assert run.prune_iter_exports(keep=0) == []  # 0 keeps all


def test_a_folder_in_the_previous_layout_is_refused_naming_it_and_what_to_do(run, tmp_path):
    """megamu's previous layout (safetensors + state.json, retired) is no longer read: the error names the folder and
    the way out, instead of loading nothing or failing inside torch_dist."""
    old = tmp_path / "old"
    folder = old / "iter_0000001"
    (folder / "model").mkdir(parents=True)
    (folder / "state.json").write_text('{"format": "megamu-checkpoint-1", "iteration": 1}')
    (old / "latest_checkpointed_iteration.txt").write_text("1")
    model, opt = fresh(run["arch"])
    named = re.escape(str(folder))
    with pytest.raises(CheckpointError, match=named + r": a checkpoint in megamu's previous layout.*7cf1936"):
        load_checkpoint(old, model, run["arch"], opt)
    (folder / "state.json").unlink()
    with pytest.raises(CheckpointError, match=named + r": not a torch_dist checkpoint"):
        load_checkpoint(old, model, run["arch"], opt)


def test_a_checkpoint_without_run_state_starts_a_new_run_from_its_weights(run, tmp_path):
    """What Megatron-LM writes has no megamu_state.json: its weights (and Adam moments) load, no run state."""
    import shutil

    from megamu.runtime.device import CPU
    from megamu.training.policy import CheckpointConfig, Policy, PolicyConfig

    foreign = tmp_path / "megatron"
    shutil.copytree(run["root"] / "save", foreign)
    (foreign / "iter_0000001" / "megamu_state.json").unlink()
    model, opt = fresh(run["arch"])
    assert load_checkpoint(foreign, model, run["arch"], opt) == {"iteration": 1, "run_state": False}
    torch.manual_seed(4)
    policy = Policy(PolicyConfig(hf_checkpoint=str(run["root"] / "hf"), device=CPU, optimizer=CFG,
                                 checkpoint=CheckpointConfig(save=tmp_path / "save", load=foreign),
                                 offload_dir=tmp_path / "offload"))
    assert policy.load_latest() is None  # a new run: stage 0, update 0
    for (n, a), (_, b) in zip(model.named_parameters(), policy.model.named_parameters()):
        assert torch.equal(a, b), n  # the checkpoint's weights, not the HF folder's
        assert torch.equal(opt.param_state(a)["exp_avg"], policy.optimizer.param_state(b)["exp_avg"]), n


def test_a_release_tracker_names_the_release_folder(run, tmp_path):
    """Megatron-LM's read_metadata (megatron/training/checkpointing.py) takes a tracker reading "release" as
    iteration 0 in <load>/release; slime's converter writes that layout. Its weights start a new run."""
    import shutil

    from megamu.runtime.device import CPU
    from megamu.training.policy import CheckpointConfig, Policy, PolicyConfig

    converted = tmp_path / "converted"
    shutil.copytree(run["path"], converted / "release")
    (converted / "release" / "megamu_state.json").unlink()  # a converter writes weights, no run state
    (converted / "latest_checkpointed_iteration.txt").write_text("release")
    model, opt = fresh(run["arch"])
    assert load_checkpoint(converted, model, run["arch"], opt) == {"iteration": 0, "run_state": False}
    assert torch.equal(model.embedding.word_embeddings.weight, run["saved_embedding"])
    policy = Policy(PolicyConfig(hf_checkpoint=str(run["root"] / "hf"), device=CPU, optimizer=CFG,
                                 checkpoint=CheckpointConfig(save=tmp_path / "save", pretrained_checkpoint=converted),
                                 offload_dir=tmp_path / "offload"))
    assert policy.load_latest() is None and policy.loaded_from == converted and not policy.resumed
    assert torch.equal(policy.model.embedding.word_embeddings.weight, run["saved_embedding"])
    (converted / "latest_checkpointed_iteration.txt").write_text("relase")
    with pytest.raises(CheckpointError, match="relase"):
        load_checkpoint(converted, model, run["arch"], opt)


def test_the_runs_own_checkpoint_comes_before_its_start_point(run, tmp_path):
    """--load A --save B: B's checkpoint, once there is one, is where a restart resumes; A is only the start."""
    import shutil

    from megamu.runtime.device import CPU
    from megamu.training.policy import CheckpointConfig, Policy, PolicyConfig

    start, own = tmp_path / "A", tmp_path / "B"
    shutil.copytree(run["root"] / "save", start)
    cfg = dict(hf_checkpoint=str(run["root"] / "hf"), device=CPU, optimizer=CFG,
               checkpoint=CheckpointConfig(save=own, load=start), offload_dir=tmp_path / "offload")
    policy = Policy(PolicyConfig(**cfg))
    assert policy.load_latest() == {"stage": 2, "update_offset": 9, "iteration": 1}
    assert policy.loaded_from == start and not policy.resumed
    policy.save(5, extra={"stage": 3, "update_offset": 0})
    again = Policy(PolicyConfig(**cfg))
    assert again.load_latest() == {"stage": 3, "update_offset": 0, "iteration": 5}
    assert again.loaded_from == own and again.resumed


def test_common_state_holds_what_megatron_lms_load_checkpoint_reads(run):
    """NVIDIA/Megatron-LM megatron/training/checkpointing.py at d98e8a6: generate_state_dict (:1556-1635) writes
    args / checkpoint_version / iteration / opt_param_scheduler / rng_state; load_checkpoint reads args' TP/PP
    (:2559-2562), check_checkpoint_args compares the model's shape (:176-220), consumed_train_samples (:2878)."""
    from megatron.core import dist_checkpointing

    common = dist_checkpointing.load_common_state_dict(str(run["path"]))
    assert common["iteration"] == 1 and common["checkpoint_version"] == 3.0
    hf = json.loads((run["root"] / "hf" / "config.json").read_text())  # the model's own description
    args = common["args"]
    assert (args.num_layers, args.hidden_size, args.num_attention_heads, args.max_position_embeddings) == (
        hf["num_hidden_layers"], hf["hidden_size"], hf["num_attention_heads"], hf["max_position_embeddings"])
    assert args.add_position_embedding is False and args.tokenizer_type == "HuggingFaceTokenizer"
    assert args.padded_vocab_size % args.make_vocab_size_divisible_by == 0 >= hf["vocab_size"] - args.padded_vocab_size
    assert (args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.iteration) == (1, 1, 1)
    # a CPU process has no CUDA RNG: Megatron-LM skips the RNG when no_save_rng is set (:2572-2595, :3071)
    assert args.no_save_rng is True and "rng_state" not in common
    assert set(common["opt_param_scheduler"]) == {"max_lr", "lr_warmup_steps", "num_steps", "lr_decay_style",
                                                  "lr_decay_steps", "min_lr", "start_wd", "end_wd", "wd_incr_style",
                                                  "wd_incr_steps"}


def test_the_scheduler_state_gives_megatrons_scheduler_megamus_learning_rate():
    """megatron-core's own OptimizerParamScheduler, loaded from what megamu writes, gives megamu's LR past warmup
    and the weight decay (in warmup Megatron-LM's update N uses N/W of the LR, megamu's (N+1)/W)."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from megamu.training.megatron_schema import opt_param_scheduler

    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=1.0)
    for iteration in (3, 5, 40):
        state = opt_param_scheduler(CFG, iteration, samples_per_update=16, total_updates=64)
        sched = OptimizerParamScheduler(opt, init_lr=0.0, max_lr=1.0, min_lr=0.0, lr_warmup_steps=1,
                                        lr_decay_steps=2, lr_decay_style="linear", start_wd=0.0, end_wd=0.0,
                                        wd_incr_steps=2, wd_incr_style="constant",
                                        use_checkpoint_opt_param_scheduler=True)
        sched.load_state_dict(state)
        assert sched.get_lr(opt.param_groups[0]) == pytest.approx(CFG.lr_at(iteration))
        assert sched.get_wd() == pytest.approx(CFG.weight_decay)


@pytest.mark.parametrize("style", ["cosine", "linear"])
def test_the_scheduler_state_records_a_decaying_schedule(style):
    """A decaying run's schedule, not a constant one: megatron-core's scheduler loaded from the state gives, at
    Megatron's step k (k updates done), megamu's lr of update k - 1 (lr_at counts one step later), warmup, decay and
    the floor past lr_decay_iters included."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from megamu.training.megatron_schema import opt_param_scheduler

    cfg = OptimizerConfig(lr=1e-3, min_lr=1e-4, lr_warmup_iters=2, lr_decay_style=style, lr_decay_iters=20)
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=1.0)
    for iteration in (1, 5, 12, 20, 25):
        state = opt_param_scheduler(cfg, iteration, samples_per_update=16, total_updates=64)
        assert (state["lr_decay_style"], state["min_lr"], state["lr_decay_steps"]) == (style, 1e-4, 20 * 16)
        sched = OptimizerParamScheduler(opt, init_lr=0.0, max_lr=1.0, min_lr=0.0, lr_warmup_steps=1,
                                        lr_decay_steps=2, lr_decay_style="constant", start_wd=0.0, end_wd=0.0,
                                        wd_incr_steps=2, wd_incr_style="constant",
                                        use_checkpoint_opt_param_scheduler=True)
        sched.load_state_dict(state)
        assert sched.get_lr(opt.param_groups[0]) == pytest.approx(cfg.lr_at(iteration - 1), rel=1e-12)


def test_a_gpu_runs_rng_state_is_where_megatron_lm_looks_for_it(run, tmp_path, monkeypatch):
    """The ShardedObject a GPU run writes (its CUDA states left out: no GPU here), loaded back with the template
    Megatron-LM's get_rng_state builds for torch_dist (checkpointing.py:493-505: key "rng_state", shape (PP, TP), offset
    (pp_rank, tp_rank))."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    from megamu.training import megatron_schema

    state = {"random_rng_state": random.getstate(), "torch_rng_state": torch.get_rng_state()}
    monkeypatch.setattr(megatron_schema, "rng_state", lambda: megatron_schema.rng_sharded_object(state))
    model, opt = fresh(run["arch"])
    folder = save_checkpoint(tmp_path / "gpu", 3, model, run["arch"], opt, extra={})
    template = {"rng_state": ShardedObject("rng_state", None, (1, 1), (0, 0), replica_id=0)}
    loaded = dist_checkpointing.load(template, str(folder))["rng_state"]
    assert loaded[0]["random_rng_state"] == state["random_rng_state"]
    assert torch.equal(loaded[0]["torch_rng_state"], state["torch_rng_state"])
    model2, opt2 = fresh(run["arch"])
    assert load_checkpoint(tmp_path / "gpu", model2, run["arch"], opt2)["iteration"] == 3  # megamu's load ignores it


def test_no_save_optim_writes_the_weights_alone_and_a_resume_restarts_adam(run, tmp_path):
    """Megatron's --no-save-optim: no optimiser state in the checkpoint (the host plan's fix for a node whose RAM
    cannot hold the save's host copy of it); the weights and the run state come back, the moments start at zero."""
    from megatron.core import dist_checkpointing

    model, opt = fresh(run["arch"])
    load_checkpoint(run["root"] / "save", model, run["arch"], opt)
    path = save_checkpoint(tmp_path, 1, model, run["arch"], opt, extra={"stage": 2}, save_optim=False)
    keys = dist_checkpointing.load_tensors_metadata(str(path))
    assert keys and not [k for k in keys if k.startswith("optimizer.")]
    assert json.loads((path / "megamu_state.json").read_text())["has_optimizer_state"] is False
    again, opt2 = fresh(run["arch"])
    assert load_checkpoint(tmp_path, again, run["arch"], opt2)["stage"] == 2
    assert torch.equal(again.embedding.word_embeddings.weight, run["saved_embedding"])
    assert all(opt2.param_state(p) is None for p in again.parameters())  # Adam starts afresh
