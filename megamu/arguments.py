"""Command-line flags: Megatron-LM names for shared concepts, ours for μ-GRPO. Validated up front, errors name the flag.

With no flags at all the program runs the embedded default: the CPU demo (SmolLM2-135M-Instruct on two-digit addition).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
from dataclasses import asdict, dataclass
from pathlib import Path

from megamu.algo import AGGREGATIONS, ALGORITHM_PRESETS, VETO_SCOPES, AlgoConfig, algo_preset
from megamu.data.stage_prompts import PromptsConfig
from megamu.device import Device
from megamu.errors import ConfigError
from megamu.policy import PolicyConfig
from megamu.reward.config import CODE_MODES, REWARD_KINDS, RewardConfig
from megamu.rollout import ENGINE_KINDS, EngineConfig
from megamu.rollout.modes import ROLLOUT_MODES, RolloutConfig
from megamu.training.optimizer import OptimizerConfig

BUILTIN_DATA = "builtin:addition"  # the demo task: seeded two-digit additions, generated in-process


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pretrain_mu_grpo.py", description=__doc__, allow_abbrev=False)
    g = p.add_argument_group("model and parallelism (Megatron names)")
    g.add_argument("--hf-checkpoint", default=None, help="initial policy as an HF folder (default: the demo model)")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--transformer-impl", choices=["local", "transformer_engine"], default=None,
                   help="layer implementation (default: transformer_engine on GPU, local on CPU)")
    g.add_argument("--bf16", action="store_true")
    g.add_argument("--seed", type=int, default=1234)

    g = p.add_argument_group("optimiser (Megatron names)")
    g.add_argument("--lr", type=float, default=1e-5)
    g.add_argument("--lr-warmup-iters", type=int, default=0)
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.999)
    g.add_argument("--adam-eps", type=float, default=1e-8)
    g.add_argument("--clip-grad", type=float, default=1.0)
    g.add_argument("--micro-batch-size", type=int, default=8, help="samples per micro-batch")
    g.add_argument("--max-tokens-per-micro-batch", type=int, default=None, help="token budget of a micro-batch")

    g = p.add_argument_group("checkpoints and logging (Megatron names)")
    g.add_argument("--save", default="runs/cpu-demo", help="run directory: checkpoints, HF exports, rollouts, metrics")
    g.add_argument("--load", default=None, help="checkpoint directory to resume from (default: --save)")
    g.add_argument("--save-interval", type=int, default=0, help="updates between checkpoints (0: stage ends only)")
    g.add_argument("--hf-export-interval", type=int, default=0,
                   help="also export the policy as <save>/hf/iter_N every N updates, for evaluation (0: off)")
    g.add_argument("--tensorboard-dir", default=None, help="default: <save>/tensorboard")
    g.add_argument("--log-interval", type=int, default=1)

    g = p.add_argument_group("data")
    g.add_argument("--prompt-data", default=BUILTIN_DATA, help="FILE[,FILE...] jsonl/parquet, or builtin:addition")
    g.add_argument("--prompt-key", default="problem")
    g.add_argument("--answer-key", default=None, help="default: 'answer', or 'tests' with --reward code")
    g.add_argument("--max-prompt-length", type=int, default=1024)
    g.add_argument("--skip-bad-rows", action="store_true")
    g.add_argument("--reward-fn", default=None,
                   help="module:function(response, ground_truth) -> float; overrides --reward")
    add_reward_arguments(p)

    g = p.add_argument_group("μ-GRPO stages")
    g.add_argument("--num-stages", type=int, default=2)
    g.add_argument("--prompts-per-stage", type=int, default=None, help="B_train: prompt groups per rollout stage")
    g.add_argument("--prompts-per-update", type=int, default=None, help="B_mini: prompt groups per optimiser update")
    g.add_argument("--mu", type=int, default=None, help="updates per stage, μ = B_train / B_mini")
    g.add_argument("--n-samples-per-prompt", type=int, default=8, help="G")
    g.add_argument("--algorithm", choices=sorted(ALGORITHM_PRESETS), default="mu-grpo")
    g.add_argument("--clip-low", type=float, default=None)
    g.add_argument("--clip-high", type=float, default=None)
    g.add_argument("--nav-threshold", type=float, default=None, help="τ of the negative-advantage veto")
    g.add_argument("--nav-scope", choices=VETO_SCOPES, default=None)
    g.add_argument("--m2po-threshold", type=float, default=None)
    g.add_argument("--loss-aggregation", choices=AGGREGATIONS, default=None)
    g.add_argument("--behaviour-logprobs", choices=["engine", "recompute"], default="engine")
    g.add_argument("--skip-zero-advantage", action=argparse.BooleanOptionalAction, default=True,
                   help="skip the forward/backward of A = 0 samples (all-equal groups): same update, less compute")

    g = p.add_argument_group("rollout")
    g.add_argument("--rollout-mode", choices=ROLLOUT_MODES, default="staged")
    g.add_argument("--rollout-temperature", type=float, default=1.0)
    g.add_argument("--rollout-top-p", type=float, default=1.0)
    g.add_argument("--rollout-max-response-len", type=int, default=64)
    g.add_argument("--rollout-groups-per-shard", type=int, default=16, help="prompt groups per durable shard")
    g.add_argument("--rollout-shards-per-call", type=int, default=1,
                   help="shards handed to the engine at once (SGLang servers want hundreds of requests in flight)")
    add_engine_arguments(p)

    g = p.add_argument_group("run control")
    g.add_argument("--dry-run", action="store_true", help="validate and print the plan; start nothing")
    g.add_argument("--eval-prompts", type=int, default=100, help="held-out greedy evaluation at start and end (0: off)")
    return p


def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    """The engine's flags, one spelling for the trainer and tools/evaluate.py (read back by ``engine_config``)."""
    g = p.add_argument_group("rollout engine")
    g.add_argument("--rollout-engine", choices=ENGINE_KINDS, default="local")
    g.add_argument("--rollout-batch-size", type=int, default=64, help="local engine: sequences decoded together")
    g.add_argument("--rollout-dtype", choices=["float32", "bfloat16"], default="float32",
                   help="local engine: weight dtype")
    g.add_argument("--sglang-url", default=None, help="URL[,URL...] of running servers or a router")
    g.add_argument("--sglang-num-servers", type=int, default=1)
    g.add_argument("--sglang-tp-size", type=int, default=1)
    g.add_argument("--sglang-server-args", default="",
                   help='extra launch_server flags, e.g. "--mem-fraction-static 0.8 --enable-deterministic-inference"')


def add_reward_arguments(p: argparse.ArgumentParser) -> None:
    """The reward's flags, one spelling for the trainer and tools/evaluate.py (read back by ``reward_config``)."""
    g = p.add_argument_group("reward")
    g.add_argument("--reward", choices=REWARD_KINDS, default="math",
                   help="math: last \\boxed{} vs the answer (math-verify); code: the last ```python block runs "
                        "against the row's tests in a sandbox")
    g.add_argument("--code-reward-mode", choices=CODE_MODES, default="all",
                   help="code: 1 only when every test passes, or the fraction of stdin/stdout cases passed")
    g.add_argument("--code-sandbox-url", default=None,
                   help="code: run programs on this sandbox service (megamu/reward/remote.py) instead of locally")
    g.add_argument("--code-timeout", type=float, default=10.0,
                   help="code: wall-clock and CPU seconds of one program execution (one test case)")


def reward_config(args: argparse.Namespace) -> RewardConfig:
    """The run's reward (``megamu.reward.make_scorer`` builds its pool); code flags without --reward code are an
    error, so a flag that would do nothing is never silently ignored."""
    if args.reward != "code":
        for flag, value, default in (("--code-reward-mode", args.code_reward_mode, "all"),
                                     ("--code-sandbox-url", args.code_sandbox_url, None),
                                     ("--code-timeout", args.code_timeout, 10.0)):
            if value != default:
                _error(flag, "only used with --reward code")
    if args.code_sandbox_url and not args.code_sandbox_url.startswith(("http://", "https://")):
        _error("--code-sandbox-url", f"expected an http(s):// URL, got {args.code_sandbox_url!r}")
    if args.reward_fn and ":" not in args.reward_fn:
        _error("--reward-fn", f"expected module:function, got {args.reward_fn!r}")
    return _config(RewardConfig, kind=args.reward, reward_fn=args.reward_fn, code_mode=args.code_reward_mode,
                   sandbox_url=args.code_sandbox_url, timeout_s=args.code_timeout,
                   num_workers=getattr(args, "reward_workers", None))


def answer_key(args: argparse.Namespace) -> str:
    """--answer-key, by default the key the reward reads: a code row's tests, or a math row's answer."""
    return args.answer_key or ("tests" if args.reward == "code" else "answer")


def engine_config(args: argparse.Namespace) -> EngineConfig:
    for flag in ("rollout_batch_size", "sglang_num_servers", "sglang_tp_size"):
        if getattr(args, flag) <= 0:
            _error("--" + flag.replace("_", "-"), f"must be a positive integer, got {getattr(args, flag)}")
    if args.rollout_engine == "local" and (args.sglang_url or args.sglang_server_args):
        _error("--sglang-url/--sglang-server-args", "only used with --rollout-engine sglang")
    urls = tuple(u for u in (args.sglang_url or "").split(",") if u)
    return EngineConfig(kind=args.rollout_engine, dtype=args.rollout_dtype, max_batch_size=args.rollout_batch_size,
                        sglang_urls=urls, sglang_num_servers=args.sglang_num_servers,
                        sglang_tp_size=args.sglang_tp_size,
                        sglang_server_args=tuple(shlex.split(args.sglang_server_args)))


@dataclass
class Plan:
    """The run's shape: how many stages, updates and samples (printed by --dry-run)."""

    num_stages: int
    mu: int
    prompts_per_stage: int
    prompts_per_update: int
    n_samples_per_prompt: int
    max_response_len: int
    algorithm: str
    rollout_mode: str

    @property
    def total_updates(self) -> int:
        return self.num_stages * self.mu

    @property
    def samples_per_stage(self) -> int:
        return self.prompts_per_stage * self.n_samples_per_prompt

    def summary(self) -> dict:
        """Every count the plan implies (weight syncs: one per stage, the engine's refresh)."""
        return {**asdict(self), "updates_per_stage": self.mu, "total_updates": self.total_updates,
                "samples_per_stage": self.samples_per_stage, "total_samples": self.num_stages * self.samples_per_stage,
                "max_tokens_per_stage": self.samples_per_stage * self.max_response_len,
                "weight_syncs": self.num_stages}

    def describe(self, algo: AlgoConfig, precision: str) -> str:
        d = self.summary()
        rows = [
            ("stages", d["num_stages"]), ("μ (updates per stage)", d["mu"]),
            ("B_train (prompts per stage)", d["prompts_per_stage"]),
            ("B_mini (prompts per update)", d["prompts_per_update"]),
            ("G (samples per prompt)", d["n_samples_per_prompt"]), ("total updates", d["total_updates"]),
            ("samples per stage", d["samples_per_stage"]), ("total samples", d["total_samples"]),
            ("max response tokens per stage", d["max_tokens_per_stage"]), ("weight syncs", d["weight_syncs"]),
            ("rollout mode", d["rollout_mode"]), ("training precision", precision),
            ("algorithm", f"{d['algorithm']} {algo.describe()}"),
        ]
        width = max(len(k) for k, _ in rows)
        return "\n".join(f"  {k:<{width}}  {v}" for k, v in rows)

    def json_line(self) -> str:
        return "plan: " + json.dumps(self.summary())


@dataclass(frozen=True)
class RunConfig:
    """Everything a run is built from: one config per part, plus the loop's own settings (megamu.trainer.Run)."""

    plan: Plan
    algo: AlgoConfig
    device: Device
    policy: PolicyConfig
    rollout: RolloutConfig
    prompts: PromptsConfig
    save: Path
    tensorboard_dir: str
    seed: int
    tensor_model_parallel_size: int
    log_interval: int = 1
    save_interval: int = 0
    hf_export_interval: int = 0
    recompute_behaviour_logprobs: bool = False
    dry_run: bool = False

    def describe(self) -> str:
        return self.plan.describe(self.algo, "bf16" if self.policy.bf16 else "fp32")


# Config fields whose flag is not "--" + the field's name with dashes.
FLAG_OF_FIELD = {
    "veto_threshold": "--nav-threshold", "veto_scope": "--nav-scope", "aggregation": "--loss-aggregation",
    "name": "--algorithm", "kind": "--reward", "code_mode": "--code-reward-mode", "sandbox_url": "--code-sandbox-url",
    "timeout_s": "--code-timeout",
}


def _error(flag: str, message: str):
    raise SystemExit(f"pretrain_mu_grpo.py: error: {flag}: {message}")


def _config(make, **kwargs):
    """Build a part's config; a ConfigError (which names a field) becomes an error naming the flag."""
    try:
        return make(**kwargs)
    except ConfigError as e:
        _error(FLAG_OF_FIELD.get(e.field, "--" + e.field.replace("_", "-")), e.message)


def resolve_batch_sizes(args: argparse.Namespace) -> None:
    """Derive the missing one of B_train, B_mini, μ (B_train = μ · B_mini); reject inconsistent combinations."""
    b_train, b_mini, mu = args.prompts_per_stage, args.prompts_per_update, args.mu
    for flag, v in (("--prompts-per-stage", b_train), ("--prompts-per-update", b_mini), ("--mu", mu)):
        if v is not None and v <= 0:
            _error(flag, f"must be a positive integer, got {v}")
    given = sum(v is not None for v in (b_train, b_mini, mu))
    if given == 0:  # the CPU demo: 64 prompts per stage, 4 per update
        b_train, b_mini = 64, 4
    elif given == 1 and b_mini is None:
        b_mini = 4 if b_train is None else min(4, b_train)
    elif given == 1:
        mu = 16
    if b_train is None:
        b_train = mu * b_mini
    elif b_mini is None:
        if b_train % mu:
            _error("--mu", f"--prompts-per-stage {b_train} is not divisible by --mu {mu}")
        b_mini = b_train // mu
    if b_train % b_mini:
        _error("--prompts-per-update", f"--prompts-per-stage {b_train} is not a multiple of {b_mini}")
    if mu is not None and mu * b_mini != b_train:
        _error("--mu", f"--mu {mu} contradicts --prompts-per-stage {b_train} / --prompts-per-update {b_mini}")
    args.prompts_per_stage, args.prompts_per_update, args.mu = b_train, b_mini, b_train // b_mini


def check_paths(args: argparse.Namespace) -> None:
    """Inputs must exist before anything starts; a dry run of a cluster script on a laptop only warns."""
    missing = []
    if args.hf_checkpoint and not os.path.exists(os.path.join(args.hf_checkpoint, "config.json")):
        missing.append(("--hf-checkpoint", f"{args.hf_checkpoint} has no config.json"))
    if args.prompt_data != BUILTIN_DATA:
        for f in args.prompt_data.split(","):
            if not os.path.exists(f):
                missing.append(("--prompt-data", f"{f} does not exist"))
    for flag, message in missing:
        if not args.dry_run:
            _error(flag, message)
        print(f"warning: {flag}: {message} (ignored by --dry-run)", flush=True)


def check_device(args: argparse.Namespace, device: Device) -> None:
    """What the device cannot do is refused here, before any process group or model exists."""
    if args.bf16 and not device.is_cuda:
        message = ("needs a GPU: the CPU optimiser keeps no fp32 master weights, so CPU runs train in fp32 "
                   "(drop --bf16 here)")
        if not args.dry_run:
            _error("--bf16", message)
        print(f"warning: --bf16: {message} (ignored by --dry-run: the plan is for a GPU machine)", flush=True)
    if args.transformer_impl == "transformer_engine" and not device.is_cuda and not args.dry_run:
        _error("--transformer-impl", "transformer_engine needs a GPU; use local on CPU")


def validate(args: argparse.Namespace) -> None:
    positive = ["num_stages", "n_samples_per_prompt", "micro_batch_size", "rollout_max_response_len",
                "tensor_model_parallel_size", "max_prompt_length", "log_interval",
                "rollout_groups_per_shard", "rollout_shards_per_call"]
    for name in positive:
        if getattr(args, name) <= 0:
            _error("--" + name.replace("_", "-"), f"must be a positive integer, got {getattr(args, name)}")
    for name in ("save_interval", "eval_prompts", "hf_export_interval"):
        if getattr(args, name) < 0:
            _error("--" + name.replace("_", "-"), "must be >= 0")
    if not 0 < args.rollout_temperature:
        _error("--rollout-temperature", f"must be > 0, got {args.rollout_temperature}")
    if not 0 < args.rollout_top_p <= 1:
        _error("--rollout-top-p", f"must be in (0, 1], got {args.rollout_top_p}")
    if not (0 <= args.adam_beta1 < 1 and 0 <= args.adam_beta2 < 1):
        _error("--adam-beta1/--adam-beta2", "must be in [0, 1)")
    if args.n_samples_per_prompt < 2:
        _error("--n-samples-per-prompt", "GRPO needs at least 2 samples per prompt for group advantages")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world % args.tensor_model_parallel_size:
        _error("--tensor-model-parallel-size", f"{args.tensor_model_parallel_size} does not divide world size {world}")
    reward_config(args)  # its errors before any path check
    check_paths(args)
    resolve_batch_sizes(args)


def parse_args(argv: list[str] | None = None, device: Device | None = None) -> RunConfig:
    """Flags -> RunConfig, every check done (errors name the flag). ``device``: the machine's, unless given."""
    args = build_parser().parse_args(argv)
    device = device or Device.detect()
    validate(args)
    check_device(args, device)
    algo = _config(algo_preset(args.algorithm).with_overrides, clip_low=args.clip_low, clip_high=args.clip_high,
                   veto_threshold=args.nav_threshold, veto_scope=args.nav_scope, m2po_threshold=args.m2po_threshold,
                   aggregation=args.loss_aggregation)
    optimizer = _config(OptimizerConfig, lr=args.lr, weight_decay=args.weight_decay, adam_beta1=args.adam_beta1,
                        adam_beta2=args.adam_beta2, adam_eps=args.adam_eps, clip_grad=args.clip_grad,
                        lr_warmup_iters=args.lr_warmup_iters)
    save = Path(args.save)
    plan = Plan(num_stages=args.num_stages, mu=args.mu, prompts_per_stage=args.prompts_per_stage,
                prompts_per_update=args.prompts_per_update, n_samples_per_prompt=args.n_samples_per_prompt,
                max_response_len=args.rollout_max_response_len, algorithm=algo.name, rollout_mode=args.rollout_mode)
    policy = PolicyConfig(
        hf_checkpoint=args.hf_checkpoint, device=device, optimizer=optimizer, save_dir=save,
        load_dir=Path(args.load or args.save), transformer_impl=args.transformer_impl, bf16=args.bf16,
        micro_batch_size=args.micro_batch_size, max_tokens_per_micro_batch=args.max_tokens_per_micro_batch,
        temperature=args.rollout_temperature, skip_zero_advantage=args.skip_zero_advantage)
    rollout = RolloutConfig(
        mode=args.rollout_mode, engine=engine_config(args), run_dir=save, n_samples=args.n_samples_per_prompt,
        seed=args.seed, temperature=args.rollout_temperature, top_p=args.rollout_top_p,
        max_new_tokens=args.rollout_max_response_len, groups_per_shard=args.rollout_groups_per_shard,
        shards_per_call=args.rollout_shards_per_call, reward=reward_config(args))
    builtin = args.prompt_data == BUILTIN_DATA
    prompts = PromptsConfig(
        files=() if builtin else tuple(args.prompt_data.split(",")), prompts_per_stage=args.prompts_per_stage,
        held_out=args.eval_prompts, seed=args.seed, data_dir=save / "data",
        # enough rows that the held-out split (at most half the data) holds all --eval-prompts problems
        builtin_rows=max(args.num_stages * args.prompts_per_stage, args.eval_prompts) + args.eval_prompts
        if builtin else 0,
        prompt_key=args.prompt_key, answer_key=answer_key(args), max_prompt_length=args.max_prompt_length,
        skip_bad_rows=args.skip_bad_rows)
    return RunConfig(
        plan=plan, algo=algo, device=device, policy=policy, rollout=rollout, prompts=prompts, save=save,
        tensorboard_dir=args.tensorboard_dir or str(save / "tensorboard"), seed=args.seed,
        tensor_model_parallel_size=args.tensor_model_parallel_size, log_interval=args.log_interval,
        save_interval=args.save_interval, hf_export_interval=args.hf_export_interval,
        recompute_behaviour_logprobs=args.behaviour_logprobs == "recompute", dry_run=args.dry_run)
