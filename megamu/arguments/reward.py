"""Flags of the reward, shared by the trainer and tools/evaluate.py: generated from RewardConfig's fields; the run's
flags are handed to a slime-style reward function as its ``args``."""

from __future__ import annotations

import argparse
import json

from megamu.arguments.flag_errors import build_config, field_default, flag_error
from megamu.arguments.generated import add_fields, field_values
from megamu.reward.config import RewardConfig


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
            if value != field_default(RewardConfig, field):
                flag_error(flag, "only used with --reward code")
    if args.code_sandbox_url and not args.code_sandbox_url.startswith(("http://", "https://")):
        flag_error("--code-sandbox-url", f"expected an http(s):// URL, got {args.code_sandbox_url!r}")
    return build_config(RewardConfig, at="rollout.reward", **field_values(RewardConfig, args),
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
