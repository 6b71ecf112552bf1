"""One config tree: a RunConfig built in code runs as the one built from the same flags (the settings that follow
from the mode and the device are filled in by RunConfig, not by the flags), and a config error names the flag of the
field it is about, by its dotted path (no two fields of one name share a flag by accident)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from megamu.algo import algo_preset
from megamu.arguments import build_parser, flag_of, parse_args
from megamu.data.stage_prompts import PromptsConfig
from megamu.device import Device
from megamu.engines import EngineConfig, SGLangConfig
from megamu.errors import ConfigError
from megamu.loop_config import AsyncConfig
from megamu.plan import AsyncPlan, StagedPlan
from megamu.policy import CheckpointConfig, PolicyConfig
from megamu.rollout import RolloutConfig
from megamu.run_config import RunConfig
from megamu.run_dir import RunDir
from megamu.training.optimizer import OptimizerConfig

URL = "http://sglang-host:30000"
B_MINI, G, RESPONSE = 4, 8, 64
STAGED = ["--num-stages", "2", "--prompts-per-stage", "8", "--prompts-per-update", "4"]  # μ = 2: 4 updates
ASYNC = ["--train-iters", "8", "--prompts-per-update", "4", "--weight-sync-interval", "2", "--max-policy-lag", "4"]
CASES = [(mode, engine, device) for mode in ("staged", "colocated", "async") for engine in ("local", "sglang")
         for device in ("cpu", "cuda")]


def flags(save: Path, mode: str, engine: str, *extra: str) -> list[str]:
    return ["--save", str(save), "--rollout-mode", mode, *(ASYNC if mode == "async" else STAGED),
            *(["--rollout-engine", "sglang", "--sglang-url", URL] if engine == "sglang" else
              ["--rollout-engine", "local"]), *extra]


def in_code(save: Path, mode: str, engine: str, device: str, *, policy: dict | None = None,
            sglang: dict | None = None, async_: dict | None = None, checkpoint: dict | None = None,
            **run) -> RunConfig:
    """The run of ``flags(...)`` written out in code, every setting that follows from the mode and the device left
    at its dataclass default (unless given)."""
    if mode == "async":
        plan = AsyncPlan(prompts_per_update=B_MINI, n_samples_per_prompt=G, max_response_len=RESPONSE,
                         algorithm="mu-grpo", train_iters=8, weight_sync_interval=2, max_policy_lag=4)
    else:
        plan = StagedPlan(prompts_per_update=B_MINI, n_samples_per_prompt=G, max_response_len=RESPONSE,
                          algorithm="mu-grpo", rollout_mode=mode, num_stages=2, mu=2)
    updates = 8 if mode == "async" else 4
    return RunConfig(
        plan=plan, algo=algo_preset("mu-grpo"), device=Device(device),
        policy=PolicyConfig(hf_checkpoint=None, device=Device(device), optimizer=OptimizerConfig(
            lr_decay_iters=updates), checkpoint=CheckpointConfig(save=save, **(checkpoint or {})),
            offload_dir=RunDir(save).offload, **(policy or {})),
        engine=EngineConfig(kind=engine, sglang=SGLangConfig(urls=[URL], **(sglang or {})) if engine == "sglang"
                            else SGLangConfig()),
        rollout=RolloutConfig(n_samples=G, max_new_tokens=RESPONSE),
        prompts=PromptsConfig(files=(), prompts_per_stage=None if mode == "async" else 8, held_out=100,
                              seed=1234, data_dir=RunDir(save).data, builtin_rows=200, max_response_len=RESPONSE),
        seed=1234, async_=AsyncConfig(**(async_ or {})) if mode == "async" else None, **run)


@pytest.mark.parametrize("mode, engine, device", CASES)
def test_a_config_built_in_code_equals_the_one_built_from_flags(tmp_path, mode, engine, device):
    save = tmp_path / "run"
    assert in_code(save, mode, engine, device) == parse_args(flags(save, mode, engine), device=Device(device))


@pytest.mark.parametrize("mode, engine, device", CASES)
def test_explicit_values_win_over_the_derived_ones_alike(tmp_path, mode, engine, device):
    save = tmp_path / "run"
    extra = ["--offload-train", "--keep-hf-exports", "0", "--rollout-dtype", "float32", "--bf16"]
    kw: dict = dict(policy=dict(offload_train=True, bf16=True), checkpoint=dict(keep_hf_exports=0),
                    dry_run=True)
    if engine == "sglang":
        extra += ["--weight-sync", "disk", "--no-sglang-memory-saver", "--weight-sync-address", "10.0.0.1"]
        kw["sglang"] = dict(weight_sync="disk", memory_saver=False, sync_master_address="10.0.0.1")
    if mode == "async":
        extra += ["--rollout-queue-groups", "5"]
        kw["async_"] = dict(queue_groups=5)
    cfg = parse_args(flags(save, mode, engine, *extra, "--dry-run"), device=Device(device))
    code = in_code(save, mode, engine, device, **kw)
    code = RunConfig(**{**vars(code), "engine": EngineConfig(kind=engine, dtype="float32", sglang=code.engine.sglang)})
    assert code == cfg
    assert (cfg.policy.offload_train, cfg.keep_hf_exports, cfg.engine.dtype) == (True, 0, "float32")


@pytest.mark.parametrize("mode, engine, device", CASES)
def test_what_follows_from_the_mode_and_the_device(tmp_path, mode, engine, device):
    """The settings a run derives, against the rules as the flags' help states them."""
    cfg = in_code(tmp_path / "run", mode, engine, device)
    colocated, gpu = mode == "colocated", device == "cuda"
    assert cfg.policy.offload_train is (mode != "async")  # the engine takes turns with the trainer for the device
    assert cfg.keep_hf_exports == cfg.policy.checkpoint.keep == 2
    assert cfg.engine.dtype == "float32" and cfg.tensorboard_dir == str(tmp_path / "run" / "tensorboard")
    sg = cfg.engine.sglang
    if engine == "sglang":
        assert (sg.weight_sync, sg.memory_saver, sg.shares_trainer_devices, sg.sync_backend) == (
            "memory" if colocated else "disk", colocated and gpu, colocated, "nccl" if gpu else "gloo")
        assert sg.sync_master_address == os.environ.get("MASTER_ADDR", "127.0.0.1")
    else:
        assert sg == SGLangConfig()  # the local engine has no SGLang settings to derive
    if mode == "async":
        # (K - N) x B_mini less a shard of 16 groups, at least one update's groups
        assert cfg.async_.queue_groups == max(B_MINI, (4 - 2) * B_MINI - 16) == 4
        cores = os.cpu_count() or 2
        assert (cfg.async_.worker_threads, cfg.cpu_threads) == (
            (None, None) if gpu else (max(1, cores // 2), max(1, cores - max(1, cores // 2))))


def test_bf16_training_makes_a_bfloat16_engine(tmp_path):
    cfg = in_code(tmp_path / "run", "staged", "sglang", "cuda", policy=dict(bf16=True))
    assert cfg.engine.dtype == "bfloat16" and cfg.engine.sglang.dtype == "float32"  # build_engine passes it on


def test_an_error_inside_the_tree_carries_its_dotted_path(tmp_path):
    with pytest.raises(ConfigError) as e:
        in_code(tmp_path / "run", "staged", "sglang", "cpu", sglang=dict(weight_sync="memory"))
    assert e.value.field == "engine.sglang.weight_sync" and flag_of(e.value.field) == "--weight-sync"
    with pytest.raises(ConfigError) as e:
        in_code(tmp_path / "run", "async", "local", "cpu", async_=dict(queue_groups=3))
    assert e.value.field == "async_.queue_groups" and flag_of(e.value.field) == "--rollout-queue-groups"
    assert ConfigError("top_p", "x").within("rollout").within("").field == "rollout.top_p"


@pytest.mark.parametrize("path, flag", [
    ("engine.kind", "--rollout-engine"), ("rollout.reward.kind", "--reward"),
    ("policy.temperature", "--rollout-temperature"), ("rollout.temperature", "--rollout-temperature"),
    ("evaluation.eval_temperature", "--eval-temperature"),
    ("plan.max_response_len", "--rollout-max-response-len"), ("prompts.max_response_len", "--rollout-max-response-len"),
    ("memory.max_response_len", "--max-response-len"),  # the memory plan's copy: set by no flag of its own
    ("rollout.reward.timeout_s", "--code-timeout"), ("engine.sglang.url_timeout_s", "--sglang-url-timeout"),
    ("tracker.mode", "--wandb-mode"), ("tracker.wandb", "--use-wandb"),  # carried by the fields (generated parts)
    ("algo.veto_scope", "--nav-scope"), ("algo.aggregation", "--loss-aggregation"), ("algo.name", "--algorithm"),
    ("evaluation.n_samples_per_eval_prompt", "--n-samples-per-eval-prompt"),
])
def test_fields_of_one_name_map_to_their_own_flags(path, flag):
    assert flag_of(path) == flag


# Every engine field that has a flag, as the flags were written out before they moved onto the fields.
ENGINE_FLAGS = {
    "kind": "--rollout-engine", "dtype": "--rollout-dtype", "max_batch_size": "--local-engine-batch-size",
    **{f"sglang.{name}": flag for name, flag in (
        ("urls", "--sglang-url"), ("router", "--sglang-router"), ("num_servers", "--sglang-num-servers"),
        ("tp_size", "--sglang-tp-size"), ("host", "--sglang-host"), ("port_base", "--sglang-port-base"),
        ("server_python", "--sglang-python"), ("server_env", "--sglang-env"),
        ("extra_server_args", "--sglang-server-args"), ("url_timeout_s", "--sglang-url-timeout"),
        ("startup_timeout_s", "--sglang-startup-timeout"), ("probe_period_s", "--rollout-probe-period"),
        ("probe_timeout_s", "--rollout-probe-timeout"), ("probe_misses", "--rollout-probe-misses"),
        ("max_restarts", "--rollout-max-restarts"), ("server_concurrency", "--sglang-server-concurrency"),
        ("deterministic", "--rollout-deterministic"), ("weight_sync", "--weight-sync"),
        ("memory_saver", "--sglang-memory-saver"), ("sync_master_address", "--weight-sync-address"))},
}


def test_every_engine_field_names_its_own_flag():
    found = {path.removeprefix("engine."): flag for path, flag in _flag_fields(RunConfig) if path.startswith("engine.")}
    assert found == ENGINE_FLAGS  # carried by the fields, none lost or added in the move
    assert {path: flag_of("engine." + path) for path in ENGINE_FLAGS} == ENGINE_FLAGS
    assert flag_of("engine.sglang") == "--rollout-engine"  # the part as a whole carries no flag: FLAG_OF_PATH's


def test_engine_flags_read_back_as_the_config_built_in_code():
    """Each SGLang flag reaches its field; the three given as strings are converted (list, shell words, dict)."""
    from megamu.arguments import engine_flags

    def engine(*extra):
        return engine_flags(build_parser().parse_args(["--rollout-engine", "sglang", *extra]))

    assert engine("--sglang-url", URL) == EngineConfig(kind="sglang", sglang=SGLangConfig(urls=[URL]))
    assert engine_flags(build_parser().parse_args([])) == EngineConfig(kind=None)  # the run's device decides
    given = engine("--sglang-url", f"{URL},http://b:1", "--sglang-server-args", "--mem-fraction-static 0.8",
                   "--sglang-env", "A=1 B='x y'", "--sglang-host", "0.0.0.0", "--rollout-probe-period", "2",
                   "--rollout-probe-misses", "5", "--sglang-num-servers", "2", "--rollout-deterministic",
                   "--no-sglang-memory-saver", "--weight-sync", "disk", "--local-engine-batch-size", "8",
                   "--rollout-dtype", "bfloat16")
    assert given == EngineConfig(kind="sglang", dtype="bfloat16", max_batch_size=8, sglang=SGLangConfig(
        urls=[URL, "http://b:1"], extra_server_args=["--mem-fraction-static", "0.8"],
        server_env={"A": "1", "B": "x y"}, host="0.0.0.0", probe_period_s=2.0, probe_misses=5, num_servers=2,
        deterministic=True, memory_saver=False, weight_sync="disk"))
    with pytest.raises(SystemExit, match="--sglang-env: expected NAME=VALUE items"):
        engine("--sglang-env", "A")
    with pytest.raises(SystemExit, match="--rollout-probe-misses: must be a positive integer"):
        engine("--rollout-probe-misses", "0")


def test_a_list_field_needs_a_flag_default_of_its_own():
    from megamu.config_fields import flag

    with pytest.raises(TypeError, match="--x: a field with a default_factory needs a flag_default"):
        flag("--x", default_factory=list)


@pytest.mark.parametrize("bad, message", [
    (["--rollout-temperature", "0"], "--rollout-temperature: must be > 0"),
    (["--eval-temperature", "0"], "--eval-temperature: must be > 0"),
    (["--rollout-engine", "sglang", "--sglang-url", URL, "--sglang-url-timeout", "0"], "--sglang-url-timeout"),
    (["--reward", "code", "--code-timeout", "0"], "--code-timeout"),
    (["--rollout-max-response-len", "0"], "--rollout-max-response-len: must be a positive integer"),
    (["--rollout-engine", "sglang", "--sglang-url", URL, "--weight-sync", "memory"],
     "--weight-sync: memory needs --rollout-mode colocated"),
    (["--nav-threshold", "2"], "--nav-threshold: must be in (0, 1)"),
    (["--keep-hf-exports", "-1"], "--keep-hf-exports: must be >= 0"),
])
def test_a_config_error_names_the_flag_of_its_field(tmp_path, bad, message):
    with pytest.raises(SystemExit) as e:
        parse_args(["--save", str(tmp_path / "run"), *bad], device=Device("cpu"))
    assert message in str(e.value)


def test_every_mapped_flag_exists():
    from megamu.arguments.engine import FLAG_OF_PATH

    known = {s for a in build_parser()._actions for s in a.option_strings}
    assert {f.split()[0] for f in FLAG_OF_PATH.values()} - known == set()


def test_typed_plans_count_their_own_shape():
    staged = StagedPlan(prompts_per_update=4, n_samples_per_prompt=8, max_response_len=64, algorithm="grpo",
                        rollout_mode="colocated", num_stages=3, mu=5)
    assert (staged.total_updates, staged.prompts_per_stage, staged.weight_syncs, staged.is_async) == (15, 20, 3, False)
    assert staged.summary()["max_tokens_per_stage"] == 20 * 8 * 64
    stream = AsyncPlan(prompts_per_update=4, n_samples_per_prompt=8, max_response_len=64, algorithm="grpo",
                       train_iters=9, weight_sync_interval=4, max_policy_lag=8)
    assert (stream.total_updates, stream.weight_syncs, stream.mu, stream.num_stages) == (9, 2, None, None)
    assert (stream.rollout_mode, stream.is_async, stream.summary()["total_samples"]) == ("async", True, 9 * 4 * 8)
    with pytest.raises(TypeError):  # a stage count has no place in an async plan
        AsyncPlan(prompts_per_update=4, n_samples_per_prompt=8, max_response_len=64, algorithm="grpo",
                  train_iters=9, weight_sync_interval=4, max_policy_lag=8, num_stages=2)


def test_generated_flags_default_to_their_fields():
    """A part whose fields carry their flags gets them from the tree: each flag's default is the field's (AlgoConfig's
    are None, "the preset's"), and the values read back build the part's defaults."""
    from megamu.algo import AlgoConfig
    from megamu.arguments.generated import ALGO_FLAGS, field_values
    from megamu.loop_config import EvalConfig
    from megamu.tracking import TrackerConfig

    args = build_parser().parse_args([])
    assert EvalConfig(**field_values(EvalConfig, args)) == EvalConfig()
    assert TrackerConfig(**field_values(TrackerConfig, args)) == TrackerConfig()
    assert OptimizerConfig(**field_values(OptimizerConfig, args)) == OptimizerConfig()
    assert field_values(AlgoConfig, args, attached=ALGO_FLAGS) == dict.fromkeys(ALGO_FLAGS)
    given = build_parser().parse_args(["--eval-top-p", "0.5", "--wandb-dir", "w", "--nav-scope", "suffix"])
    assert (given.eval_top_p, given.wandb_dir, given.nav_scope) == (0.5, Path("w"), "suffix")


def _flag_fields(cls: type, prefix: str = ""):
    """(dotted path, flag) of every field below ``cls`` that carries its flag, walking the parts by type hint."""
    import dataclasses
    import typing

    from megamu.arguments.generated import _part_types
    from megamu.config_fields import flag_spec

    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        spec = flag_spec(cls, f.name)
        if spec is not None:
            yield prefix + f.name, spec.names[0]
        for part in _part_types(hints[f.name]):
            if part is not cls:
                yield from _flag_fields(part, prefix + f.name + ".")


def test_every_flag_a_field_carries_is_a_flag_of_the_parser_and_names_its_errors():
    from megamu.arguments.generated import ALGO_FLAGS

    found = dict(_flag_fields(RunConfig)) | {f"algo.{n}": s.names[0] for n, s in ALGO_FLAGS.items()}
    assert found["plan.max_policy_lag"] == "--max-policy-lag"  # the plan's union: AsyncPlan's fields are walked too
    assert found["policy.checkpoint.keep"] == "--keep-checkpoints" and len(found) >= 40
    known = {s for a in build_parser()._actions for s in a.option_strings}
    assert set(found.values()) - known == set()
    assert {path: flag_of(path) for path in found} == found


def test_an_engine_on_its_own_refuses_memory_weight_sync_naming_its_own_fix():
    """tools/evaluate.py's engine (engine_config) has no rollout mode: its refusal names the flag it does have."""
    import argparse

    from megamu.arguments import add_engine_arguments, engine_config

    p = argparse.ArgumentParser()
    add_engine_arguments(p)
    args = p.parse_args(["--rollout-engine", "sglang", "--sglang-url", URL, "--weight-sync", "memory"])
    with pytest.raises(SystemExit, match="--weight-sync: memory .* use --weight-sync disk") as e:
        engine_config(args)
    assert "--rollout-mode" not in str(e.value)
