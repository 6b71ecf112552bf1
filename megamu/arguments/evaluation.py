"""Flags of evaluation during training and of experiment tracking (slime's names where slime has them)."""

from __future__ import annotations

import argparse

from megamu.arguments.flag_errors import build_config, flag_error
from megamu.arguments.generated import add_fields, field_values
from megamu.config.loop_config import EvalConfig
from megamu.data.stage_prompts import PromptsConfig
from megamu.observability.tracking import TrackerConfig


def add_evaluation_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("evaluation during training (slime's names)")
    add_fields(g, PromptsConfig, ["held_out"])
    g.add_argument("--eval-prompt-data", nargs="+", default=[], metavar="NAME PATH",
                   help="named evaluation sets, e.g. --eval-prompt-data aime24 aime24.jsonl math500 math500.jsonl "
                        "(rows like --prompt-data's, with answers; prompts built as in training)")
    add_fields(g, EvalConfig)

    g = p.add_argument_group("experiment tracking (tensorboard always; wandb with --use-wandb)")
    add_fields(g, TrackerConfig)


def eval_sets(args: argparse.Namespace) -> tuple[tuple[str, str], ...]:
    """--eval-prompt-data NAME PATH pairs; names unique and not the split-off set's."""
    items = args.eval_prompt_data
    if len(items) % 2:
        flag_error("--eval-prompt-data", f"expected NAME PATH pairs, got {len(items)} words: {' '.join(items)}")
    pairs = tuple(zip(items[::2], items[1::2]))
    names = [n for n, _ in pairs]
    for name in names:
        if names.count(name) > 1 or name == "held-out":
            flag_error("--eval-prompt-data", f"set name {name!r} is used twice or is the split-off set's ('held-out')")
    return pairs


def evaluation_config(args: argparse.Namespace) -> EvalConfig:
    return build_config(EvalConfig, at="evaluation", **field_values(EvalConfig, args))


def tracker_config(args: argparse.Namespace) -> TrackerConfig:
    if not args.use_wandb:
        return TrackerConfig()
    try:
        import wandb  # noqa: F401
    except ImportError:
        flag_error("--use-wandb", "wandb is not installed here: pip install wandb")
    return build_config(TrackerConfig, at="tracker", **field_values(TrackerConfig, args))
