"""Flags of evaluation during training and of experiment tracking (slime's names where slime has them)."""

from __future__ import annotations

import argparse
from pathlib import Path

from megamu.arguments.engine import _config, _default, _error
from megamu.loop_config import EvalConfig
from megamu.tracking import WANDB_MODES, TrackerConfig


def add_evaluation_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("evaluation during training (slime's names)")
    g.add_argument("--eval-prompts", type=int, default=100,
                   help="training prompts held out as the 'held-out' evaluation set (0: none)")
    g.add_argument("--eval-prompt-data", nargs="+", default=[], metavar="NAME PATH",
                   help="named evaluation sets, e.g. --eval-prompt-data aime24 aime24.jsonl math500 math500.jsonl "
                        "(rows like --prompt-data's, with answers; prompts built as in training)")
    g.add_argument("--eval-interval", type=int, default=_default(EvalConfig, "eval_interval"),
                   help="updates between evaluations, a multiple of μ: they run on the engine at a stage's start, "
                        "where it holds the policy (0: before the first update and after the last only)")
    g.add_argument("--n-samples-per-eval-prompt", type=int,
                   default=_default(EvalConfig, "n_samples_per_eval_prompt"),
                   help="k sampled replies per problem: sampled pass@1 (mean over k, the paper's avg@k) and pass@k "
                        "beside greedy accuracy (0: greedy only)")
    g.add_argument("--eval-temperature", type=float, default=_default(EvalConfig, "eval_temperature"))
    g.add_argument("--eval-top-p", type=float, default=_default(EvalConfig, "eval_top_p"))

    g = p.add_argument_group("experiment tracking (tensorboard always; wandb with --use-wandb)")
    g.add_argument("--use-wandb", action="store_true",
                   help="log every record and a table of each stage's sample generations to Weights & Biases "
                        "(pip install wandb); a resumed run continues the same wandb run")
    g.add_argument("--wandb-project", default=_default(TrackerConfig, "project"))
    g.add_argument("--wandb-group", default=None)
    g.add_argument("--wandb-name", default=None, help="default: the --save folder's name")
    g.add_argument("--wandb-mode", choices=WANDB_MODES, default=_default(TrackerConfig, "mode"),
                   help="offline: write under --wandb-dir without a network (`wandb sync` uploads it later)")
    g.add_argument("--wandb-dir", default=None, help="default: --save")


def eval_sets(args: argparse.Namespace) -> tuple[tuple[str, str], ...]:
    """--eval-prompt-data NAME PATH pairs; names unique and not the split-off set's."""
    items = args.eval_prompt_data
    if len(items) % 2:
        _error("--eval-prompt-data", f"expected NAME PATH pairs, got {len(items)} words: {' '.join(items)}")
    pairs = tuple(zip(items[::2], items[1::2]))
    names = [n for n, _ in pairs]
    for name in names:
        if names.count(name) > 1 or name == "held-out":
            _error("--eval-prompt-data", f"set name {name!r} is used twice or is the split-off set's ('held-out')")
    return pairs


def evaluation_config(args: argparse.Namespace) -> EvalConfig:
    return _config(EvalConfig, at="evaluation", eval_interval=args.eval_interval,
                   n_samples_per_eval_prompt=args.n_samples_per_eval_prompt, eval_temperature=args.eval_temperature,
                   eval_top_p=args.eval_top_p)


def tracker_config(args: argparse.Namespace) -> TrackerConfig:
    if not args.use_wandb:
        return TrackerConfig()
    try:
        import wandb  # noqa: F401
    except ImportError:
        _error("--use-wandb", "wandb is not installed here: pip install wandb")
    return _config(TrackerConfig, at="tracker", wandb=True, project=args.wandb_project, group=args.wandb_group,
                   name=args.wandb_name, mode=args.wandb_mode,
                   dir=Path(args.wandb_dir) if args.wandb_dir else None)
