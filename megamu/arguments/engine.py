"""Flags of the rollout engine and the reward, shared by the trainer and tools/evaluate.py, and how a part's config
error becomes an error naming its flag (the configs name their fields by dotted path; FLAG_OF_PATH maps them to
flags).
"""

from __future__ import annotations

import argparse
import dataclasses
import shlex
from dataclasses import replace

from megamu.arguments.generated import add_fields, field_flag, field_values
from megamu.device import CPU, Device
from megamu.engines import ENGINE_KINDS, EngineConfig, SGLangConfig
from megamu.errors import ConfigError
from megamu.reward.config import RewardConfig
from megamu.run_config import RunConfig


def _default(config, name: str):
    """A flag's default is its config field's: written once, in the dataclass."""
    f = config.__dataclass_fields__[name]
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


# The flag of each config field (a dotted path in RunConfig's tree) whose flag is not "--" + its own name with dashes,
# for the parts whose flags are still written out in this package (a generated part's fields carry their flags).
FLAG_OF_PATH = {
    "async_": "--rollout-mode",
    "recompute_behaviour_logprobs": "--behaviour-logprobs",
    "plan.max_response_len": "--rollout-max-response-len",
    "algo.name": "--algorithm",
    "policy.temperature": "--rollout-temperature",
    "engine.kind": "--rollout-engine", "engine.dtype": "--rollout-dtype", "engine.max_batch_size":
    "--local-engine-batch-size", "engine.sglang": "--rollout-engine",
    "prompts.files": "--prompt-data", "prompts.builtin_rows": "--prompt-data",
    "prompts.context_length": "--hf-checkpoint", "prompts.max_response_len": "--rollout-max-response-len",
    "prompts.eval_sets": "--eval-prompt-data",
    "memory.mem_fraction_static": "--sglang-server-args (--mem-fraction-static)", "memory.model": "--hf-checkpoint",
    "memory.tp": "--tensor-model-parallel-size", "memory.ep": "--expert-model-parallel-size",
    "memory.server_tp": "--sglang-tp-size",
    **{f"engine.sglang.{name}": flag for name, flag in (
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


def flag_of(path: str) -> str:
    """The flag that sets the config field at dotted ``path`` of RunConfig: the one the field carries (generated
    parts), else the one FLAG_OF_PATH lists (parts whose flags are still written out here), else the field's name."""
    return field_flag(RunConfig, path) or FLAG_OF_PATH.get(path, "--" + path.rsplit(".", 1)[-1].replace("_", "-"))


def _error(flag: str, message: str):
    raise SystemExit(f"pretrain_mu_grpo.py: error: {flag}: {message}")


def _config(make, *, at: str = "", **kwargs):
    """Build the config at dotted path ``at`` of RunConfig's tree (or run a check on one); a ConfigError, which names
    a field, becomes an error naming its flag."""
    try:
        return make(**kwargs)
    except ConfigError as e:
        _error(flag_of(e.within(at).field), e.message)


def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    """The engine's flags, one spelling for the trainer and tools/evaluate.py (read back by ``engine_config``)."""
    g = p.add_argument_group("rollout engine")
    g.add_argument("--rollout-engine", choices=ENGINE_KINDS, default=_default(EngineConfig, "kind"))
    g.add_argument("--local-engine-batch-size", type=int, default=_default(EngineConfig, "max_batch_size"),
                   help="local engine: sequences decoded together (slime's --rollout-batch-size is prompts per "
                        "rollout: megamu's --prompts-per-stage)")
    g.add_argument("--rollout-dtype", choices=["float32", "bfloat16"], default=None,
                   help="the precision the engine computes in: the local engine's weights, SGLang servers' --dtype "
                        "(default: bfloat16 with --bf16, else float32; the weights it loads: --export-dtype)")
    g.add_argument("--sglang-url", default=None, help="URL[,URL...] of running servers or a router")
    g.add_argument("--sglang-host", default=_default(SGLangConfig, "host"),
                   help="address the servers megamu launches listen on; on several nodes one the others reach, "
                        "e.g. 0.0.0.0 (they are then named by this node's host name)")
    g.add_argument("--sglang-router", default=None,
                   help="URL of a running sglang-router: the servers megamu launches on every node join it for each "
                        "stage and leave it at the stage's end, and requests go through it")
    g.add_argument("--sglang-url-timeout", type=float, default=_default(SGLangConfig, "url_timeout_s"),
                   help="seconds the given --sglang-url servers have to answer /health at start: the run starts on "
                        "those that do, naming the others, and fails after this bound when none does, naming each "
                        "URL with its error (servers megamu launches have --sglang-startup-timeout)")
    g.add_argument("--sglang-startup-timeout", type=float, default=_default(SGLangConfig, "startup_timeout_s"),
                   help="seconds a server megamu launches (or restarts) has to load its model and answer /health")
    g.add_argument("--rollout-probe-period", type=float, default=_default(SGLangConfig, "probe_period_s"),
                   help="seconds between /health_generate probes of each SGLang server while requests are out")
    g.add_argument("--rollout-probe-timeout", type=float, default=_default(SGLangConfig, "probe_timeout_s"),
                   help="seconds a probe waits for its answer")
    g.add_argument("--rollout-probe-misses", type=int, default=_default(SGLangConfig, "probe_misses"),
                   help="probes missed in a row that make a server dead (as do its exit and a refused port): a hung "
                        "server is found within misses x (period + timeout), 45 s by default; its requests go to "
                        "the live servers with the same seeds")
    g.add_argument("--rollout-max-restarts", type=int, default=_default(SGLangConfig, "max_restarts"),
                   help="restarts per stage of the dead servers megamu launched; beyond it the run stops, naming the "
                        "server, its exit status and log (a rerun resumes at the first missing shard). After an "
                        "in-memory push a restarted server gets it again from a host copy kept for that (none at 0)")
    g.add_argument("--sglang-num-servers", type=int, default=_default(SGLangConfig, "num_servers"),
                   help="servers megamu launches on each node")
    g.add_argument("--sglang-port-base", type=int, default=_default(SGLangConfig, "port_base"),
                   help="port of a node's first launched server; server i listens on port base + i")
    g.add_argument("--sglang-tp-size", type=int, default=_default(SGLangConfig, "tp_size"))
    g.add_argument("--sglang-server-args", default="",
                   help='extra launch_server flags, e.g. "--mem-fraction-static 0.8 --max-running-requests 1024"')
    g.add_argument("--sglang-server-concurrency", type=int, default=None,
                   help="sequences each SGLang server (or each worker of a router) runs at once; megamu sends it "
                        "twice that (default: the server's max_running_requests from /server_info, else 512)")
    g.add_argument("--rollout-deterministic", action="store_true",
                   help="SGLang honours each sample's seed (servers launched with --enable-deterministic-inference; "
                        "given servers must have it), so a resumed stage redraws the same samples; slower kernels. "
                        "The local engine always is")
    g.add_argument("--sglang-python", default=None,
                   help="the Python that runs servers megamu launches (default: this one), e.g. a CPU build's venv")
    g.add_argument("--sglang-env", default="",
                   help='environment of servers megamu launches, e.g. "SGLANG_USE_CPU_ENGINE=1 PYTHONPATH=/x/stubs"')
    g.add_argument("--sglang-memory-saver", action=argparse.BooleanOptionalAction, default=None,
                   help="launch servers with --enable-memory-saver and, in colocated mode, have them release their "
                        "KV cache and weights while the trainer trains (default: on for colocated runs on GPUs, "
                        "where servers share the trainer's devices)")
    g.add_argument("--weight-sync-address", default=None,
                   help="this process's address as the servers reach it, for in-memory pushes over a process group "
                        "(default: torchrun's MASTER_ADDR, else 127.0.0.1)")
    g.add_argument("--weight-sync", choices=["disk", "memory"], default=None,
                   help="SGLang refreshes: HF export + /update_weights_from_disk, or in memory: a broadcast from "
                        "rank 0 to every node's servers, or, for servers on the trainer's GPUs, tensor handles each "
                        "node pushes to its own (default: memory in --rollout-mode colocated, disk in staged)")


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
    if args.reward_fn and ":" not in args.reward_fn and "." not in args.reward_fn:
        _error("--reward-fn", f"expected module:function, file.py:function or module.function (slime's "
                              f"--custom-rm-path), got {args.reward_fn!r}")
    return _config(RewardConfig, at="rollout.reward", **field_values(RewardConfig, args), reward_fn=args.reward_fn,
                   num_workers=getattr(args, "reward_workers", None))


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
    if args.rollout_engine == "sglang":
        sglang = _config(SGLangConfig, at="engine.sglang", urls=[u for u in (args.sglang_url or "").split(",") if u],
                         num_servers=args.sglang_num_servers, tp_size=args.sglang_tp_size,
                         port_base=args.sglang_port_base,
                         extra_server_args=shlex.split(args.sglang_server_args), server_python=args.sglang_python,
                         server_env=env, weight_sync=args.weight_sync, sync_master_address=args.weight_sync_address,
                         memory_saver=args.sglang_memory_saver,
                         server_concurrency=args.sglang_server_concurrency, deterministic=args.rollout_deterministic,
                         host=args.sglang_host, router=args.sglang_router, url_timeout_s=args.sglang_url_timeout,
                         startup_timeout_s=args.sglang_startup_timeout,
                         probe_period_s=args.rollout_probe_period, probe_timeout_s=args.rollout_probe_timeout,
                         probe_misses=args.rollout_probe_misses, max_restarts=args.rollout_max_restarts)
    return _config(EngineConfig, at="engine", kind=args.rollout_engine, dtype=args.rollout_dtype,
                   max_batch_size=args.local_engine_batch_size, sglang=sglang)


def engine_config(args: argparse.Namespace, device: Device | None = None) -> EngineConfig:
    """The engine flags as an engine on its own (tools/evaluate.py) is configured: servers apart from any trainer
    (disk refreshes), computing in --rollout-dtype, else float32. A run's engine: ``RunConfig(...).engine``."""
    cfg = engine_flags(args)
    if cfg.kind == "sglang" and cfg.sglang.weight_sync == "memory":
        _error("--weight-sync", "memory needs --rollout-mode colocated (staged mode starts each stage's servers "
                                "from the stage's export)")
    sglang = cfg.sglang.placed(backend=(device or CPU).backend) if cfg.kind == "sglang" else cfg.sglang
    return replace(cfg, dtype=cfg.dtype or "float32", sglang=sglang)
