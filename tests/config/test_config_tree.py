"""One config tree, one source of truth: a RunConfig built in code from the dataclasses' defaults is the one
``parse_args`` builds from the same flags (the flags add nothing but names), any config written back as flags
(megamu.arguments.written) is rebuilt equal, every quantity is stored once (a part's copy that differs is refused
naming both paths), and every field either has a real flag of the parser or is refused by ``flag_of``.

Nothing here writes out an expected config by hand: each side is built by the other way."""

from __future__ import annotations

import dataclasses
import os
import typing
from pathlib import Path

import pytest

from megamu.algo import AlgoConfig
from megamu.arguments import build_parser, flag_of, parse_args
from megamu.arguments.flag_errors import part_types
from megamu.config.loop_config import AsyncConfig, EvalConfig
from megamu.config.plan import AsyncPlan, StagedPlan
from megamu.config.run_config import RunConfig
from megamu.data.stage_prompts import PromptsConfig
from megamu.engines import EngineConfig, SGLangConfig
from megamu.errors import ConfigError
from megamu.rollout import RolloutConfig
from megamu.runtime.device import Device
from megamu.training.optimizer import OptimizerConfig
from megamu.training.policy import CheckpointConfig, PolicyConfig

URL = "http://sglang-host:30000"
DEVICES = ("cpu", "cuda")
# A variety of launches: each mode and engine, an algorithm's overrides, DAPO, the reward, the schedule, slime's names.
FLAG_SETS = {
    "demo": [],
    "colocated-sglang": ["--rollout-mode", "colocated", "--rollout-engine", "sglang", "--sglang-url", f"{URL},http://b:1",
                         "--sglang-server-args", "--mem-fraction-static 0.8", "--sglang-env", "A=1 B='x y'",
                         "--weight-sync", "disk", "--rollout-probe-misses", "5", "--bf16", "--dry-run"],
    "staged-overrides": ["--algorithm", "grpo", "--clip-high", "0.28", "--nav-threshold", "1e-3", "--seed", "7",
                         "--rollout-temperature", "0.7", "--n-samples-per-prompt", "4", "--rollout-max-response-len",
                         "32", "--num-stages", "3", "--prompts-per-stage", "8", "--prompts-per-update", "2",
                         "--lr-decay-style", "cosine", "--min-lr", "1e-7", "--lr", "3e-6", "--eval-interval", "4",
                         "--keep-hf-exports", "0", "--micro-batch-size", "2", "--eval-prompts", "10"],
    "async": ["--rollout-mode", "async", "--train-iters", "8", "--prompts-per-update", "4", "--weight-sync-interval",
              "2", "--max-policy-lag", "6", "--rollout-queue-groups", "5", "--rollout-engine", "local"],
    "dapo-code": ["--algorithm", "dapo", "--overlong-buffer-len", "16", "--reward", "code", "--code-timeout", "3",
                  "--behaviour-logprobs", "recompute", "--rollout-top-p", "0.9", "--use-kl-loss", "--kl-loss-coef",
                  "0.01", "--no-save-optim", "--rollout-batch-size", "8", "--global-batch-size", "32"],
    "dapo-verl": ["--algorithm", "dapo", "--overlong-buffer-len", "0", "--clip-ratio-c", "10", "--filter-groups-metric",
                  "seq_reward", "--max-sampling-rounds", "0", "--fill-short-stage", "--prompts-per-sampling-round",
                  "24", "--rollout-batch-size", "8", "--prompts-per-update", "4", "--num-stages", "2"],
    "slime-grpo": ["--advantage-estimator", "grpo", "--eps-clip", "0.2", "--eps-clip-high", "0.28", "--num-rollout",
                   "2", "--rollout-batch-size", "8", "--global-batch-size", "64"],
}


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path, monkeypatch):
    """--save's default (runs/cpu-demo) is relative: each test runs in its own directory, outside any launcher."""
    monkeypatch.chdir(tmp_path)
    for var in ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "RANK"):
        monkeypatch.delenv(var, raising=False)


@pytest.mark.parametrize("device", DEVICES)
def test_the_demo_built_in_code_from_the_defaults_is_the_one_built_from_no_flags(device):
    assert RunConfig(device=Device(device)) == parse_args([], device=Device(device))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", sorted(FLAG_SETS))
def test_a_config_from_flags_round_trips_through_its_flags(name, device):
    """flags -> config -> flags (written from the tree's metadata) -> config: the same config."""
    from tests.config_flags import config_flags

    built = parse_args(FLAG_SETS[name], device=Device(device))
    assert parse_args(config_flags(built), device=Device(device)) == built


def in_code(device: str, save: Path) -> list[RunConfig]:
    """Configs built in code with settings away from the defaults in every part (the values are arbitrary: what is
    checked is that the flags written from them build the same config)."""
    dev = Device(device)
    policy = PolicyConfig(micro_batch_size=2, optimizer=OptimizerConfig(lr=3e-6, lr_decay_style="linear"),
                          checkpoint=CheckpointConfig(save=save, keep=3, save_interval=4), offload_train=False)
    staged = RunConfig(
        device=dev, seed=11, policy=policy,
        plan=StagedPlan(prompts_per_update=2, n_samples_per_prompt=4, max_response_len=48, num_stages=3, mu=2,
                        rollout_mode="colocated"),
        algo=AlgoConfig.preset("grpo-relaxed", veto_threshold=1e-3, veto_scope="suffix"),
        rollout=RolloutConfig(temperature=0.8, top_p=0.95, groups_per_shard=4),
        prompts=PromptsConfig(held_out=12, max_prompt_length=256, instruction=""),
        engine=EngineConfig(kind="local", max_batch_size=32), evaluation=EvalConfig(eval_interval=4),
        log_interval=2, gpu_memory_gib=80.0)
    stream = RunConfig(
        device=dev, policy=policy, plan=AsyncPlan(prompts_per_update=4, train_iters=12, weight_sync_interval=3,
                                                  max_policy_lag=9),
        algo=AlgoConfig.preset("m2po"), async_=AsyncConfig(queue_groups=7),
        engine=EngineConfig(kind="sglang", sglang=SGLangConfig(urls=[URL], weight_sync="disk", probe_misses=4)))
    return [staged, stream]


@pytest.mark.parametrize("device", DEVICES)
def test_a_config_built_in_code_is_the_one_its_flags_build(tmp_path, device):
    from tests.config_flags import config_flags

    for run in in_code(device, tmp_path / "run"):
        assert parse_args(config_flags(run), device=run.device) == run


# Each part's copy of a quantity the run stores once: where the run stores it, and a value other than its default.
COPIES = {"policy.temperature": ("rollout.temperature", 0.5), "rollout.seed": ("seed", 99),
          "prompts.seed": ("seed", 99), "rollout.n_samples": ("plan.n_samples_per_prompt", 3),
          "rollout.max_new_tokens": ("plan.max_response_len", 17),
          "prompts.max_response_len": ("plan.max_response_len", 17), "plan.algorithm": ("algo.name", "grpo"),
          "policy.device": ("device", Device("cuda"))}


def _at(obj, path: str):
    for name in path.split("."):
        obj = getattr(obj, name)
    return obj


@pytest.mark.parametrize("copy", sorted(COPIES))
def test_a_copy_that_differs_from_the_one_stored_is_refused_naming_both(copy):
    """e.g. a code-built config with rollout.temperature 1.0 beside policy.temperature 0.5 cannot be built."""
    source, value = COPIES[copy]
    part, name = copy.split(".")
    parts = {"plan": StagedPlan(), "rollout": RolloutConfig(), "prompts": PromptsConfig(), "policy": PolicyConfig()}
    with pytest.raises(ConfigError) as e:
        RunConfig(device=Device("cpu"), **{part: dataclasses.replace(parts[part], **{name: value})})
    assert e.value.field == copy and source in e.value.message
    same = _at(RunConfig(device=Device("cpu")), source)  # the run's own value is accepted: a copy, not a setting
    assert _at(RunConfig(device=Device("cpu"), **{part: dataclasses.replace(parts[part], **{name: same})}), copy) \
        == same


def _leaves(cls: type, prefix: str = "") -> typing.Iterator[str]:
    """Every leaf field's dotted path below ``cls``, walking the parts by type hint (the plan's union: both)."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        parts = [t for t in part_types(hints[f.name]) if t is not cls]
        if not parts:
            yield prefix + f.name
        for part in parts:
            yield from _leaves(part, prefix + f.name + ".")


def test_every_leaf_has_a_real_flag_or_is_refused():
    known = {s for a in build_parser()._actions for s in a.option_strings}
    refused = []
    for path in sorted(set(_leaves(RunConfig))):
        try:
            flag = flag_of(path)
        except KeyError:
            refused.append(path)
            continue
        assert set(flag.split(" (")[0].split("/")) <= known, (path, flag)
    assert "engine.sglang.dtype" in refused and "--dtype" not in known  # the servers' dtype is the engine's
    assert "device.type" in refused and "world_size" not in refused


def test_no_two_fields_carry_one_flag():
    """A flag sets one field; the copies of a quantity map to its flag only through their ``derived`` source."""
    from megamu.arguments.flag_errors import field_flag

    carried = [(p, field_flag(RunConfig, p)) for p in set(_leaves(RunConfig))]
    flags = [f for _, f in carried if f is not None]
    assert len(flags) == len(set(flags)), sorted(f for f in flags if flags.count(f) > 1)


def test_an_error_names_the_flag_its_field_declares():
    """flag_of reads the declarations, no table: a copy names the flag of the field it copies (followed through its
    ``derived`` source, which must reach a flag), a field set by a converted flag names that flag."""
    from megamu.arguments.flag_errors import classes_holding
    from megamu.config_fields import field_source

    known = {s for a in build_parser()._actions for s in a.option_strings}
    sources = {}
    for path in set(_leaves(RunConfig)) | {"async_", "engine.sglang"}:
        classes, name = classes_holding(RunConfig, path)
        found = [s for cls in classes if (s := field_source(cls, name)) is not None]
        if found:
            sources[path] = found[0]
    assert len(sources) >= 20
    for path, source in sources.items():
        if source.startswith("--"):
            assert set(source.split("/")) <= known, (path, source)  # a flag of the parser, written out in arguments/
        else:
            assert flag_of(path) == flag_of(source), (path, source)  # the copy's error names the original's flag
    assert flag_of("rollout.n_samples") == flag_of("plan.n_samples_per_prompt") == "--n-samples-per-prompt"
    assert flag_of("plan.algorithm") == flag_of("algo.name") == "--algorithm"  # two hops: plan -> algo -> the flag
    assert flag_of("prompts.data_dir") == "--save" and flag_of("policy.temperature") == "--rollout-temperature"


# Where a flag is not its field's name (after its part's prefix, e.g. SGLangConfig.tp_size <- --sglang-tp-size, and a
# unit suffix, _s), why (issue 52 item 3). The flags keep their spellings: users' launch scripts (slime's, verl's
# translated) carry them; the fields keep theirs: the code, presets and checkpoints' records use them.
NAMED_APART = {
    "veto_threshold": "--nav-threshold",  # τ of the negative-advantage veto (NAV, §3.3): the paper's symbol
    "veto_scope": "--nav-scope",  # the same veto's scope (App. C.2)
    "aggregation": "--loss-aggregation",  # verl's actor.loss_agg_mode
    "kl_coef": "--kl-loss-coef", "kl_type": "--kl-loss-type",  # slime's spellings
    "overlong_buffer": "--overlong-buffer-len",  # verl's reward_model.overlong_buffer.len
    "filter_metric": "--filter-groups-metric",  # verl's algorithm.filter_groups.metric
    "sampling_round_prompts": "--prompts-per-sampling-round",  # verl's data.gen_batch_size
    "keep": "--keep-checkpoints",  # the checkpoint part's field; the flag says what is kept
    "kind": "--rollout-engine",  # EngineConfig.kind; RewardConfig.kind is --reward (below: one name, two parts)
    "max_batch_size": "--local-engine-batch-size",  # the local engine's only (SGLang servers batch themselves)
    "urls": "--sglang-url", "extra_server_args": "--sglang-server-args",  # lists given as one string each
    "server_python": "--sglang-python", "server_env": "--sglang-env",
    "sync_master_address": "--weight-sync-address",  # the weight-sync group's, as --weight-sync's companion
    "code_mode": "--code-reward-mode", "num_workers": "--reward-workers",
    "max_error_fraction": "--reward-error-tolerance", "item_timeout": "--reward-timeout",
    "held_out": "--eval-prompts",  # slime-style evaluation flag; the prompts part's field says what it does
}
PART_PREFIXES = ("sglang-", "rollout-", "wandb-", "moe-", "code-", "reward-", "use-", "apply-")


def test_a_flag_and_its_field_share_a_name_or_say_why():
    apart = {}
    for path, flag in _flag_fields(RunConfig):
        name, bare = path.rsplit(".", 1)[-1], flag.removeprefix("--")
        if not any(bare.startswith(p) and bare.removeprefix(p).replace("-", "_") in (name, name.removesuffix("_s"))
                   for p in ("", *PART_PREFIXES)):
            apart.setdefault(name, set()).add(flag)
    assert apart.pop("kind") == {"--rollout-engine", "--reward"}
    assert {k: v.pop() for k, v in apart.items()} == {k: v for k, v in NAMED_APART.items() if k != "kind"}


def test_every_config_is_frozen():
    for path in ["", *{p.rsplit(".", 1)[0] for p in _leaves(RunConfig) if "." in p}]:
        for cls in _classes_at(path):
            assert cls.__dataclass_params__.frozen, cls.__name__


def _classes_at(path: str) -> tuple[type, ...]:
    classes: tuple[type, ...] = (RunConfig,)
    for part in filter(None, path.split(".")):
        classes = tuple(t for c in classes for t in part_types(typing.get_type_hints(c).get(part)))
    return classes


@pytest.mark.parametrize("mode, engine, device", [(m, e, d) for m in ("staged", "colocated", "async")
                                                  for e in ("local", "sglang") for d in DEVICES])
def test_what_follows_from_the_mode_and_the_device(tmp_path, mode, engine, device):
    """The settings a run derives, against the rules as the flags' help states them."""
    plan = AsyncPlan(train_iters=8, weight_sync_interval=2, max_policy_lag=4) if mode == "async" else \
        StagedPlan(rollout_mode=mode, num_stages=2, mu=2)
    cfg = RunConfig(plan=plan, device=Device(device), async_=AsyncConfig() if mode == "async" else None,
                    engine=EngineConfig(kind=engine, sglang=SGLangConfig(urls=[URL]) if engine == "sglang"
                                        else SGLangConfig()),
                    policy=PolicyConfig(checkpoint=CheckpointConfig(save=tmp_path / "run")))
    colocated, gpu = mode == "colocated", device == "cuda"
    assert cfg.policy.offload_train is (mode != "async")  # the engine takes turns with the trainer for the device
    assert cfg.keep_hf_exports == cfg.policy.checkpoint.keep == 2
    assert cfg.engine.dtype == "float32" and cfg.tensorboard_dir == str(tmp_path / "run" / "tensorboard")
    assert cfg.policy.optimizer.lr_decay_iters == plan.total_updates  # lr decays over the run
    assert (cfg.rollout.seed, cfg.prompts.seed, cfg.policy.temperature) == (cfg.seed, cfg.seed, cfg.rollout.temperature)
    assert cfg.rollout.max_new_tokens == cfg.prompts.max_response_len == plan.max_response_len
    assert cfg.prompts.prompts_per_stage == (None if mode == "async" else 2 * plan.prompts_per_update)
    sg = cfg.engine.sglang
    if engine == "sglang":
        assert (sg.weight_sync, sg.memory_saver, sg.shares_trainer_devices, sg.sync_backend) == (
            "memory" if colocated else "disk", colocated and gpu, colocated, "nccl" if gpu else "gloo")
        assert sg.sync_master_address == os.environ.get("MASTER_ADDR", "127.0.0.1")
    else:
        assert sg == SGLangConfig()  # the local engine has no SGLang settings to derive
    if mode == "async":
        # (K - N) x B_mini less a shard of 16 groups, at least one update's groups
        assert cfg.async_.queue_groups == max(4, (4 - 2) * 4 - 16) == 4
        cores = os.cpu_count() or 2
        assert (cfg.async_.worker_threads, cfg.cpu_threads) == (
            (None, None) if gpu else (max(1, cores // 2), max(1, cores - max(1, cores // 2))))


def test_a_cpu_dry_run_for_gpus_places_the_servers_as_the_gpus_will():
    """--bf16 on CPU plans a GPU run: its colocated servers get the memory saver, and its memory plan releases them."""
    cfg = RunConfig(device=Device("cpu"), plan=StagedPlan(rollout_mode="colocated"), dry_run=True,
                    policy=PolicyConfig(bf16=True), engine=EngineConfig(kind="sglang", sglang=SGLangConfig(urls=[URL])))
    assert cfg.for_gpu and (cfg.engine.sglang.memory_saver, cfg.engine.sglang.sync_backend) == (True, "nccl")


def test_bf16_training_makes_a_bfloat16_engine():
    cfg = RunConfig(device=Device("cuda"), policy=PolicyConfig(bf16=True), engine=EngineConfig(kind="sglang"))
    assert cfg.engine.dtype == "bfloat16" and cfg.engine.sglang.dtype == "float32"  # build_engine passes it on


def test_an_error_inside_the_tree_carries_its_dotted_path():
    with pytest.raises(ConfigError) as e:
        RunConfig(device=Device("cpu"), engine=EngineConfig(kind="sglang", sglang=SGLangConfig(weight_sync="memory")))
    assert e.value.field == "engine.sglang.weight_sync" and flag_of(e.value.field) == "--weight-sync"
    with pytest.raises(ConfigError) as e:
        RunConfig(device=Device("cpu"), plan=AsyncPlan(train_iters=8), async_=AsyncConfig(queue_groups=3))
    assert e.value.field == "async_.queue_groups" and flag_of(e.value.field) == "--rollout-queue-groups"
    assert ConfigError("top_p", "x").within("rollout").within("").field == "rollout.top_p"


@pytest.mark.parametrize("path, flag", [
    ("engine.kind", "--rollout-engine"), ("rollout.reward.kind", "--reward"),
    ("policy.temperature", "--rollout-temperature"), ("rollout.temperature", "--rollout-temperature"),
    ("evaluation.eval_temperature", "--eval-temperature"),
    ("plan.max_response_len", "--rollout-max-response-len"), ("prompts.max_response_len", "--rollout-max-response-len"),
    ("memory.max_response_len", "--rollout-max-response-len"), ("rollout.n_samples", "--n-samples-per-prompt"),
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
    assert flag_of("engine.sglang") == "--rollout-engine"  # the part as a whole: derived from engine.kind


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


def test_typed_plans_count_their_own_shape():
    staged = StagedPlan(prompts_per_update=4, n_samples_per_prompt=8, max_response_len=64, algorithm="grpo",
                        rollout_mode="colocated", num_stages=3, mu=5)
    assert (staged.total_updates, staged.prompts_per_stage, staged.weight_syncs) == (15, 20, 3)
    assert staged.mode.has_stages and not staged.mode.streams
    assert staged.summary()["max_tokens_per_stage"] == 20 * 8 * 64
    stream = AsyncPlan(prompts_per_update=4, n_samples_per_prompt=8, max_response_len=64, algorithm="grpo",
                       train_iters=9, weight_sync_interval=4, max_policy_lag=8)
    assert (stream.total_updates, stream.weight_syncs, stream.mu, stream.num_stages) == (9, 2, None, None)
    assert (stream.rollout_mode, stream.mode.streams, stream.summary()["total_samples"]) == ("async", True, 9 * 4 * 8)
    with pytest.raises(TypeError):  # a stage count has no place in an async plan
        AsyncPlan(prompts_per_update=4, n_samples_per_prompt=8, max_response_len=64, algorithm="grpo",
                  train_iters=9, weight_sync_interval=4, max_policy_lag=8, num_stages=2)


def test_generated_flags_default_to_their_fields():
    """A part whose fields carry their flags gets them from the tree: each flag's default is the field's (AlgoConfig's
    are None, "the preset's"), and the values read back build the part's defaults."""
    from megamu.arguments.generated import field_values
    from megamu.observability.tracking import TrackerConfig

    args = build_parser().parse_args([])
    assert EvalConfig(**field_values(EvalConfig, args)) == EvalConfig()
    assert TrackerConfig(**field_values(TrackerConfig, args)) == TrackerConfig()
    assert OptimizerConfig(**field_values(OptimizerConfig, args)) == OptimizerConfig()
    overrides = [f.name for f in dataclasses.fields(AlgoConfig) if f.name != "name"]  # each setting: a flag
    assert field_values(AlgoConfig, args) == dict.fromkeys(overrides) and len(overrides) == 18
    given = build_parser().parse_args(["--eval-top-p", "0.5", "--wandb-dir", "w", "--nav-scope", "suffix"])
    assert (given.eval_top_p, given.wandb_dir, given.nav_scope) == (0.5, Path("w"), "suffix")


def _flag_fields(cls: type, prefix: str = ""):
    """(dotted path, flag) of every field below ``cls`` that carries its flag, walking the parts by type hint."""
    from megamu.config_fields import flag_spec

    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        spec = flag_spec(cls, f.name)
        if spec is not None:
            yield prefix + f.name, spec.names[0]
        for part in part_types(hints[f.name]):
            if part is not cls:
                yield from _flag_fields(part, prefix + f.name + ".")


def test_every_flag_a_field_carries_is_a_flag_of_the_parser_and_names_its_errors():
    found = dict(_flag_fields(RunConfig))
    assert found["algo.veto_threshold"] == "--nav-threshold"  # AlgoConfig's fields carry theirs like every part
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
