"""Command-line flags: Megatron-LM names for shared concepts, ours for μ-GRPO. Validated up front, errors name the flag.

With no flags at all the program runs the embedded default: the CPU demo (SmolLM2-135M-Instruct on two-digit addition).
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import asdict, dataclass

from megamu.algo import ALGORITHM_PRESETS, VETO_SCOPES, AlgoConfig, algo_preset
from megamu.algo.loss import AGGREGATIONS

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
    g.add_argument("--answer-key", default="answer")
    g.add_argument("--max-prompt-length", type=int, default=1024)
    g.add_argument("--skip-bad-rows", action="store_true")
    g.add_argument("--reward-fn", default=None, help="module:function(response, ground_truth) -> float")

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
    g.add_argument("--rollout-engine", choices=["local", "sglang"], default="local")
    g.add_argument("--rollout-mode", choices=["staged", "colocated"], default="staged")
    g.add_argument("--rollout-temperature", type=float, default=1.0)
    g.add_argument("--rollout-top-p", type=float, default=1.0)
    g.add_argument("--rollout-max-response-len", type=int, default=64)
    g.add_argument("--rollout-batch-size", type=int, default=64, help="LocalEngine: sequences decoded together")
    g.add_argument("--rollout-groups-per-shard", type=int, default=16, help="prompt groups per durable shard")
    g.add_argument("--sglang-url", default=None, help="URL[,URL...] of running servers or a router")
    g.add_argument("--sglang-num-servers", type=int, default=1)
    g.add_argument("--sglang-tp-size", type=int, default=1)
    g.add_argument("--sglang-server-args", default="",
                   help='extra launch_server flags, e.g. "--mem-fraction-static 0.8 --enable-deterministic-inference"')
    g.add_argument("--rollout-shards-per-call", type=int, default=1,
                   help="shards handed to the engine at once (SGLang servers want hundreds of requests in flight)")

    g = p.add_argument_group("run control")
    g.add_argument("--dry-run", action="store_true", help="validate and print the plan; start nothing")
    g.add_argument("--eval-prompts", type=int, default=100, help="held-out greedy evaluation at start and end (0: off)")
    return p


@dataclass
class Plan:
    num_stages: int
    mu: int
    prompts_per_stage: int
    prompts_per_update: int
    n_samples_per_prompt: int
    updates_per_stage: int
    total_updates: int
    samples_per_stage: int
    total_samples: int
    max_tokens_per_stage: int
    weight_syncs: int
    algorithm: str
    rollout_mode: str

    def describe(self, algo: AlgoConfig) -> str:
        rows = [
            ("stages", self.num_stages), ("μ (updates per stage)", self.mu),
            ("B_train (prompts per stage)", self.prompts_per_stage),
            ("B_mini (prompts per update)", self.prompts_per_update),
            ("G (samples per prompt)", self.n_samples_per_prompt), ("total updates", self.total_updates),
            ("samples per stage", self.samples_per_stage), ("total samples", self.total_samples),
            ("max response tokens per stage", self.max_tokens_per_stage), ("weight syncs", self.weight_syncs),
            ("rollout mode", self.rollout_mode), ("algorithm", f"{self.algorithm} {algo.loss_kwargs()}"),
        ]
        width = max(len(k) for k, _ in rows)
        return "\n".join(f"  {k:<{width}}  {v}" for k, v in rows)

    def json_line(self) -> str:
        return "plan: " + json.dumps(asdict(self))


def _error(flag: str, message: str):
    raise SystemExit(f"pretrain_mu_grpo.py: error: {flag}: {message}")


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


def validate(args: argparse.Namespace) -> AlgoConfig:
    positive = ["num_stages", "n_samples_per_prompt", "micro_batch_size", "rollout_max_response_len",
                "tensor_model_parallel_size", "max_prompt_length", "rollout_batch_size", "log_interval",
                "rollout_groups_per_shard", "rollout_shards_per_call"]
    for name in positive:
        if getattr(args, name) <= 0:
            _error("--" + name.replace("_", "-"), f"must be a positive integer, got {getattr(args, name)}")
    for name in ("save_interval", "lr_warmup_iters", "eval_prompts", "hf_export_interval"):
        if getattr(args, name) < 0:
            _error("--" + name.replace("_", "-"), "must be >= 0")
    if args.lr <= 0:
        _error("--lr", f"must be > 0, got {args.lr}")
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
    if args.rollout_engine == "local" and (args.sglang_url or args.sglang_server_args):
        _error("--sglang-url/--sglang-server-args", "only used with --rollout-engine sglang")
    if args.reward_fn and ":" not in args.reward_fn:
        _error("--reward-fn", f"expected module:function, got {args.reward_fn!r}")
    check_paths(args)
    resolve_batch_sizes(args)
    try:
        return algo_preset(args.algorithm).with_overrides(
            clip_low=args.clip_low, clip_high=args.clip_high, veto_threshold=args.nav_threshold,
            veto_scope=args.nav_scope, m2po_threshold=args.m2po_threshold, aggregation=args.loss_aggregation,
        )
    except ValueError as e:
        _error("--algorithm", str(e))


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, AlgoConfig, Plan]:
    args = build_parser().parse_args(argv)
    algo = validate(args)
    args.load = args.load or args.save
    args.tensorboard_dir = args.tensorboard_dir or os.path.join(args.save, "tensorboard")
    g, stages = args.n_samples_per_prompt, args.num_stages
    plan = Plan(
        num_stages=stages, mu=args.mu, prompts_per_stage=args.prompts_per_stage,
        prompts_per_update=args.prompts_per_update, n_samples_per_prompt=g, updates_per_stage=args.mu,
        total_updates=stages * args.mu, samples_per_stage=args.prompts_per_stage * g,
        total_samples=stages * args.prompts_per_stage * g,
        max_tokens_per_stage=args.prompts_per_stage * g * args.rollout_max_response_len,
        weight_syncs=stages, algorithm=algo.name, rollout_mode=args.rollout_mode,
    )
    return args, algo, plan
