"""Flags of the rollout engine, shared by the trainer and tools/evaluate.py: generated from EngineConfig's and
SGLangConfig's fields; the three given as strings (URLs, server args, server environment) are converted here.
"""

from __future__ import annotations

import argparse
import shlex
from dataclasses import replace

from megamu.arguments.flag_errors import build_config, flag_error
from megamu.arguments.generated import add_fields, field_values
from megamu.engines import EngineConfig, SGLangConfig
from megamu.runtime.device import CPU, Device


def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    """The engine's flags, one spelling for the trainer and tools/evaluate.py (read back by ``engine_config``)."""
    g = p.add_argument_group("rollout engine")
    add_fields(g, EngineConfig, ["kind", "max_batch_size", "dtype"])
    add_fields(g, SGLangConfig, ["urls", "host", "router", "url_timeout_s", "startup_timeout_s", "probe_period_s",
                                 "probe_timeout_s", "probe_misses", "max_restarts", "num_servers", "port_base",
                                 "tp_size", "extra_server_args", "server_concurrency", "deterministic",
                                 "server_python", "server_env", "memory_saver", "sync_master_address", "weight_sync"])


def engine_flags(args: argparse.Namespace) -> EngineConfig:
    """The engine flags as given: what follows from the mode and device (None) is left to ``RunConfig``."""
    if args.rollout_engine == "local" and (args.sglang_url or args.sglang_server_args):
        flag_error("--sglang-url/--sglang-server-args", "only used with --rollout-engine sglang")
    if args.rollout_engine == "local" and (args.sglang_python or args.sglang_env):
        flag_error("--sglang-python/--sglang-env", "only used with --rollout-engine sglang")
    if args.rollout_engine == "local" and args.sglang_server_concurrency is not None:
        flag_error("--sglang-server-concurrency", "only used with --rollout-engine sglang")
    env = {}
    for item in shlex.split(args.sglang_env):
        if "=" not in item:
            flag_error("--sglang-env", f"expected NAME=VALUE items, got {item!r}")
        env.update([item.split("=", 1)])
    sglang = SGLangConfig()
    if args.rollout_engine != "local":  # sglang, or the device's choice: the flags given as strings, converted
        sglang = build_config(SGLangConfig, at="engine.sglang", **{
            **field_values(SGLangConfig, args),
            "urls": [u for u in (args.sglang_url or "").split(",") if u],
            "extra_server_args": shlex.split(args.sglang_server_args), "server_env": env})
    return build_config(EngineConfig, at="engine", **field_values(EngineConfig, args), sglang=sglang)


def engine_config(args: argparse.Namespace, device: Device | None = None) -> EngineConfig:
    """The engine flags as an engine on its own (tools/evaluate.py) is configured: servers apart from any trainer
    (disk refreshes), computing in --rollout-dtype, else float32. A run's engine: ``RunConfig(...).engine``."""
    args.rollout_engine = args.rollout_engine or "local"  # an engine on its own: the in-process one unless asked
    cfg = engine_flags(args)
    if cfg.kind == "sglang" and cfg.sglang.weight_sync == "memory":
        flag_error("--weight-sync", "memory pushes a trainer's weights into colocated servers; an engine on its own "
                                    "(evaluation) loads each checkpoint from disk: use --weight-sync disk")
    sglang = cfg.sglang.placed(backend=(device or CPU).backend) if cfg.kind == "sglang" else cfg.sglang
    return replace(cfg, dtype=cfg.dtype or "float32", sglang=sglang)
