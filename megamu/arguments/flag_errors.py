"""How a config error becomes an error naming its flag, for every module of megamu.arguments.

The configs name a bad field by its dotted path in RunConfig's tree (``ConfigError.field``); ``flag_of`` finds the
flag from the field's own declaration (megamu.config_fields): the flag it carries (``flag``), else the source it is
``derived`` from (another field, followed to its flag, or a flag converted by megamu.arguments). The memory plan's
fields (``memory.FIELD``) are computed from the run, not declared by it: ``MEMORY_FLAGS`` maps them.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, NoReturn

from megamu.config.run_config import RunConfig
from megamu.config_fields import field_source, flag_spec
from megamu.errors import ConfigError

# The memory plan (RunConfig.memory, computed from the run): each of its fields to the flag of the run's setting it
# is computed from, for its errors and the fixes it suggests (megamu.memory.memory_fixes).
MEMORY_FLAGS = {
    "model": "--hf-checkpoint", "micro_batch_size": "--micro-batch-size",
    "max_tokens_per_micro_batch": "--max-tokens-per-micro-batch", "max_response_len": "--rollout-max-response-len",
    "params_dtype": "--bf16", "tp": "--tensor-model-parallel-size", "ep": "--expert-model-parallel-size",
    "etp": "--expert-tensor-parallel-size",
    "recompute_granularity": "--recompute-granularity", "sequence_parallel": "--sequence-parallel",
    "transformer_impl": "--transformer-impl",
    "rollout_mode": "--rollout-mode", "offload_train": "--offload-train", "server_tp": "--sglang-tp-size",
    "mem_fraction_static": "--sglang-server-args (--mem-fraction-static)",
    "release_during_training": "--sglang-memory-saver", "weight_push": "--weight-sync",
    "gpu_memory_gib": "--gpu-memory-gib", "host_memory_gib": "--host-memory-gib", "measured_peaks": "--measured-peaks",
}


def part_types(hint) -> tuple[type, ...]:
    """The config classes a field's type hint holds (``X | None`` -> X; the plan's union -> both)."""
    options = typing.get_args(hint) if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union \
        else (hint,)
    return tuple(t for t in options if dataclasses.is_dataclass(t))


def classes_holding(root: type, path: str) -> tuple[tuple[type, ...], str]:
    """The config classes that may hold the field at dotted ``path`` below ``root`` (a union: each), and its name."""
    *parents, name = path.split(".")
    classes: tuple[type, ...] = (root,)
    for part in parents:
        classes = tuple(t for cls in classes for t in part_types(typing.get_type_hints(cls).get(part)))
    return classes, name


def field_flag(root: type, path: str) -> str | None:
    """The flag the field at dotted ``path`` below ``root`` carries itself; None if it carries none."""
    classes, name = classes_holding(root, path)
    return next((spec.names[0] for cls in classes if (spec := flag_spec(cls, name)) is not None), None)


def flag_of(path: str) -> str:
    """The flag that sets the config field at dotted ``path`` of RunConfig: the one it carries, else its source's
    (a field it is derived from, followed; or the flag megamu.arguments converts into it). A field that no flag sets
    (the device's, the servers' dtype, ...) is refused with a KeyError: no flag name is made up.
    ``memory.FIELD``: the memory plan's, MEMORY_FLAGS."""
    if path.startswith("memory."):
        return MEMORY_FLAGS[path.removeprefix("memory.")]
    found = field_flag(RunConfig, path)
    if found is not None:
        return found
    classes, name = classes_holding(RunConfig, path)
    source = next((s for cls in classes if (s := field_source(cls, name)) is not None), None)
    if source is None:
        raise KeyError(f"{path}: no flag sets this config field")
    return source if source.startswith("--") else flag_of(source)


def flag_or_path(path: str) -> str:
    """What an error about the field at ``path`` names: its flag, else (a field no flag sets) its dotted path."""
    try:
        return flag_of(path)
    except KeyError:
        return path


def flag_error(flag: str, message: str) -> NoReturn:
    """Stop the launch with argparse's error line, naming ``flag``."""
    raise SystemExit(f"pretrain_mu_grpo.py: error: {flag}: {message}")


def build_config(make, *, at: str = "", **kwargs) -> Any:
    """Build the config at dotted path ``at`` of RunConfig's tree (or run a check on one); a ConfigError, which names
    a field, becomes an error naming its flag."""
    try:
        return make(**kwargs)
    except ConfigError as e:
        flag_error(flag_or_path(e.within(at).field), e.message)


def field_default(config: type, name: str) -> Any:
    """A flag's default is its config field's: written once, in the dataclass."""
    f = config.__dataclass_fields__[name]
    return f.default_factory() if f.default is dataclasses.MISSING else f.default
