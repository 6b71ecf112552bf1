"""Flags of the rollout engine and the reward, shared by the trainer and tools/evaluate.py, and how a part's config
error becomes an error naming its flag (the configs name their fields by dotted path; a field carries its flag, and
FLAG_OF_PATH maps the fields that carry none). The engine's flags are generated from EngineConfig's and SGLangConfig's
fields; the three given as strings (URLs, server args, server environment) are converted here.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
from dataclasses import replace

from megamu.arguments.generated import add_fields, field_flag, field_values
from megamu.config.run_config import RunConfig
from megamu.engines import EngineConfig, SGLangConfig
from megamu.errors import ConfigError
from megamu.reward.config import RewardConfig
from megamu.runtime.device import CPU, Device


def _default(config, name: str):
    """A flag's default is its config field's: written once, in the dataclass."""
    f = config.__dataclass_fields__[name]
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


# The flag of each config field (a dotted path in RunConfig's tree) that carries none itself: fields set by flags
# written out in this package, and the parts' copies of a quantity the run stores once (passed down by RunConfig.derive
# from the field the flag sets). A generated part's fields carry their flags; a field in neither has no flag.
FLAG_OF_PATH = {
    "async_": "--rollout-mode",
    "recompute_behaviour_logprobs": "--behaviour-logprobs",
    "algo.name": "--algorithm", "plan.algorithm": "--algorithm",
    "plan.prompts_per_update": "--prompts-per-update", "plan.mu": "--mu", "plan.num_stages": "--num-stages",
    "plan.train_iters": "--train-iters", "plan.rollout_mode": "--rollout-mode",
    "rollout.n_samples": "--n-samples-per-prompt", "rollout.max_new_tokens": "--rollout-max-response-len",
    "rollout.seed": "--seed", "prompts.seed": "--seed",
    "policy.temperature": "--rollout-temperature",
    "policy.offload_dir": "--save", "prompts.data_dir": "--save",  # RunDir(save)'s
    "engine.sglang": "--rollout-engine",  # the SGLang part as a whole: set only with --rollout-engine sglang
    "prompts.files": "--prompt-data", "prompts.builtin_rows": "--prompt-data",
    "prompts.prompts_per_stage": "--prompts-per-stage", "prompts.answer_key": "--answer-key",
    "prompts.context_length": "--hf-checkpoint", "prompts.max_response_len": "--rollout-max-response-len",
    "prompts.eval_sets": "--eval-prompt-data",
    # the launch a dry run plans for (torchrun's WORLD_SIZE and LOCAL_WORLD_SIZE otherwise)
    "world_size": "--actor-num-nodes/--actor-num-gpus-per-node", "ranks_per_node": "--actor-num-gpus-per-node",
}

# The memory plan (RunConfig.memory, computed from the run): each of its fields to the flag of the run's setting it
# is computed from, for its errors and the fixes it suggests (megamu.memory.memory_fixes).
MEMORY_FLAGS = {
    "model": "--hf-checkpoint", "micro_batch_size": "--micro-batch-size",
    "max_tokens_per_micro_batch": "--max-tokens-per-micro-batch", "max_response_len": "--rollout-max-response-len",
    "params_dtype": "--bf16", "tp": "--tensor-model-parallel-size", "ep": "--expert-model-parallel-size",
    "recompute_granularity": "--recompute-granularity", "sequence_parallel": "--sequence-parallel",
    "transformer_impl": "--transformer-impl",
    "rollout_mode": "--rollout-mode", "offload_train": "--offload-train", "server_tp": "--sglang-tp-size",
    "mem_fraction_static": "--sglang-server-args (--mem-fraction-static)",
    "release_during_training": "--sglang-memory-saver", "weight_push": "--weight-sync",
    "gpu_memory_gib": "--gpu-memory-gib", "host_memory_gib": "--host-memory-gib", "measured_peaks": "--measured-peaks",
}


def flag_of(path: str) -> str:
    """The flag that sets the config field at dotted ``path`` of RunConfig: the one the field carries (generated
    parts), else the one FLAG_OF_PATH lists. A field that no flag sets (derived, or code-only) is refused with a
    KeyError: no flag name is made up. ``memory.FIELD``: the memory plan's, MEMORY_FLAGS."""
    if path.startswith("memory."):
        return MEMORY_FLAGS[path.removeprefix("memory.")]
    found = field_flag(RunConfig, path) or FLAG_OF_PATH.get(path)
    if found is None:
        raise KeyError(f"{path}: no flag sets this config field")
    return found


def flag_or_path(path: str) -> str:
    """What an error about the field at ``path`` names: its flag, else (a field no flag sets) its dotted path."""
    try:
        return flag_of(path)
    except KeyError:
        return path


def _error(flag: str, message: str):
    raise SystemExit(f"pretrain_mu_grpo.py: error: {flag}: {message}")


def _config(make, *, at: str = "", **kwargs):
    """Build the config at dotted path ``at`` of RunConfig's tree (or run a check on one); a ConfigError, which names
    a field, becomes an error naming its flag."""
    try:
        return make(**kwargs)
    except ConfigError as e:
        _error(flag_or_path(e.within(at).field), e.message)


def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    """The engine's flags, one spelling for the trainer and tools/evaluate.py (read back by ``engine_config``)."""
    g = p.add_argument_group("rollout engine")
    add_fields(g, EngineConfig, ["kind", "max_batch_size", "dtype"])
    add_fields(g, SGLangConfig, ["urls", "host", "router", "url_timeout_s", "startup_timeout_s", "probe_period_s",
                                 "probe_timeout_s", "probe_misses", "max_restarts", "num_servers", "port_base",
                                 "tp_size", "extra_server_args", "server_concurrency", "deterministic",
                                 "server_python", "server_env", "memory_saver", "sync_master_address", "weight_sync"])


def add_reward_arguments(p: argparse.ArgumentParser) -> None:
    """The reward's flags, one spelling for the trainer and tools/evaluate.py (read back by ``reward_config``)."""
    g = p.add_argument_group("reward")
    add_fields(g, RewardConfig)


def reward_config(args: argparse.Namespace) -> RewardConfig:
    """The run's reward (``megamu.reward.make_scorer`` builds its pool); code flags without --reward code are an
    error, so a flag that would do nothing is never silently ignored."""
    if args.reward != "code":
        for flag, value, field in (("--code-reward-mode", args.code_reward_mode, "code_mode"),
                                   ("--code-sandbox-url", args.code_sandbox_url, "sandbox_url"),
                                   ("--code-timeout", args.code_timeout, "timeout_s")):
            if value != _default(RewardConfig, field):
                _error(flag, "only used with --reward code")
    if args.code_sandbox_url and not args.code_sandbox_url.startswith(("http://", "https://")):
        _error("--code-sandbox-url", f"expected an http(s):// URL, got {args.code_sandbox_url!r}")
    return _config(RewardConfig, at="rollout.reward", **field_values(RewardConfig, args),
                   run_args=run_namespace(args))


def run_namespace(args: argparse.Namespace) -> dict:
    """slime's ``custom_rm(args, sample)`` gets the run's flags as ``args``: each under its argparse name
    (``args.n_samples_per_prompt``, ``args.reward_fn``, ...), as JSON values (paths as strings): the reward workers
    are other processes."""
    def plain(value):
        try:
            json.dumps(value)
            return value
        except TypeError:
            return str(value)
    return {k: plain(v) for k, v in vars(args).items() if not k.startswith("_")}


def answer_key(args: argparse.Namespace) -> str:
    """--answer-key, by default the key the reward reads: a code row's tests, or a math row's answer."""
    return args.answer_key or ("tests" if args.reward == "code" else "answer")


def engine_flags(args: argparse.Namespace) -> EngineConfig:
    """The engine flags as given: what follows from the mode and device (None) is left to ``RunConfig``."""
    if args.rollout_engine == "local" and (args.sglang_url or args.sglang_server_args):
        _error("--sglang-url/--sglang-server-args", "only used with --rollout-engine sglang")
    if args.rollout_engine == "local" and (args.sglang_python or args.sglang_env):
        _error("--sglang-python/--sglang-env", "only used with --rollout-engine sglang")
    if args.rollout_engine == "local" and args.sglang_server_concurrency is not None:
        _error("--sglang-server-concurrency", "only used with --rollout-engine sglang")
    env = {}
    for item in shlex.split(args.sglang_env):
        if "=" not in item:
            _error("--sglang-env", f"expected NAME=VALUE items, got {item!r}")
        env.update([item.split("=", 1)])
    sglang = SGLangConfig()
    if args.rollout_engine != "local":  # sglang, or the device's choice: the flags given as strings, converted
        sglang = _config(SGLangConfig, at="engine.sglang", **{
            **field_values(SGLangConfig, args),
            "urls": [u for u in (args.sglang_url or "").split(",") if u],
            "extra_server_args": shlex.split(args.sglang_server_args), "server_env": env})
    return _config(EngineConfig, at="engine", **field_values(EngineConfig, args), sglang=sglang)


def engine_config(args: argparse.Namespace, device: Device | None = None) -> EngineConfig:
    """The engine flags as an engine on its own (tools/evaluate.py) is configured: servers apart from any trainer
    (disk refreshes), computing in --rollout-dtype, else float32. A run's engine: ``RunConfig(...).engine``."""
    args.rollout_engine = args.rollout_engine or "local"  # an engine on its own: the in-process one unless asked
    cfg = engine_flags(args)
    if cfg.kind == "sglang" and cfg.sglang.weight_sync == "memory":
        _error("--weight-sync", "memory pushes a trainer's weights into colocated servers; an engine on its own "
                                "(evaluation) loads each checkpoint from disk: use --weight-sync disk")
    sglang = cfg.sglang.placed(backend=(device or CPU).backend) if cfg.kind == "sglang" else cfg.sglang
    return replace(cfg, dtype=cfg.dtype or "float32", sglang=sglang)
