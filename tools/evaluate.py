#!/usr/bin/env python
"""Evaluate an HF folder, or every HF checkpoint of a run, on math or code benchmarks: avg@k pass@1 (App. B).

    python tools/evaluate.py --hf-dir MODEL --data aime24=../shared/data/aime24.jsonl --data math500=...
    python tools/evaluate.py --run runs/qwen3-1.7b --data aime24=... --rollout-engine sglang --sglang-num-servers 4
    python tools/convert_code_data.py --humaneval -o humaneval.jsonl
    python tools/evaluate.py --hf-dir MODEL --reward code --data humaneval=humaneval.jsonl

Defaults follow the paper: 16 samples for AIME24/25, 4 for AMC23 and MATH-500 (``--samples name=k`` overrides);
prompts go through the training template (``load_prompts``). With ``--run``, prompts are built as that run built
them (its ``data/prompt_settings.json``: prompt and answer keys, instruction, chat template, prompt length) and
replies get its length; flags given here win.
Writes ``<out>/<checkpoint>.json|.md`` and ``<out>/summary.json|.md`` (the best average over checkpoints).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runnable as a script from a checkout

from megamu.arguments import add_engine_arguments, add_reward_arguments, answer_key, engine_config, reward_config  # noqa: E402
from megamu.data.prompts import DEFAULT_INSTRUCTION  # noqa: E402
from megamu.data.stage_prompts import PROMPT_SETTINGS  # noqa: E402
from megamu.evaluation import Checkpoint, EvalSettings, evaluate_checkpoints, parse_benchmarks, run_checkpoints  # noqa: E402
from megamu.reward.config import RewardConfig  # noqa: E402
from megamu.run.run_dir import RunDir  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--hf-dir", help="an HF model folder to evaluate")
    src.add_argument("--run", help="a run's --save dir: evaluates every folder under RUN/hf/ and reports the best")
    p.add_argument("--data", action="append", default=[], metavar="NAME=PATH",
                   help="benchmark JSONL/Parquet with problem/answer rows (repeatable)")
    p.add_argument("--samples", action="append", default=[], metavar="NAME=K",
                   help="samples per problem for one benchmark (default 16 for aime24/aime25, 4 otherwise)")
    p.add_argument("--limit", type=int, default=None, help="only the first N problems of each benchmark (quick runs)")
    p.add_argument("--out", default=None, help="report folder (default RUN/eval, or eval/<name of --hf-dir>)")
    g = p.add_argument_group("generation (use the training values)")
    # None: the --run's setting, else RUN_DEFAULTS'
    g.add_argument("--max-response-len", type=int, default=None, help="= --rollout-max-response-len of training")
    g.add_argument("--temperature", type=float, default=1.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--max-prompt-length", type=int, default=None)
    g.add_argument("--skip-bad-rows", action="store_true", default=None,
                   help="drop problems whose prompt is over --max-prompt-length instead of failing")
    g.add_argument("--prompt-key", default=None)
    g.add_argument("--answer-key", default=None, help="default: 'answer', or 'tests' with --reward code")
    g.add_argument("--instruction", default=None, help="text appended to each text problem (default: the run's, "
                                                       "else the paper's step-by-step \\boxed{} instruction)")
    g.add_argument("--apply-chat-template", action=argparse.BooleanOptionalAction, default=None,
                   dest="chat_template", help="default: the run's, else when the tokenizer has one")
    add_reward_arguments(p)  # the trainer's reward flags, same spelling
    add_engine_arguments(p)  # the trainer's engine flags, same spelling
    p.add_argument("--save-responses", action="store_true", help="also write <out>/<checkpoint>.responses.jsonl")
    p.add_argument("--overwrite", action="store_true", help="re-evaluate checkpoints that already have a report")
    args = p.parse_args(argv)
    run_prompt_settings(args)
    for flag, value in (("--limit", args.limit), ("--max-response-len", args.max_response_len)):
        if value is not None and value < 1:
            p.error(f"{flag} must be >= 1, got {value}")
    if args.temperature < 0 or not 0 < args.top_p <= 1:
        p.error(f"--temperature must be >= 0 and --top-p in (0, 1], got {args.temperature} and {args.top_p}")
    args.answer_key = answer_key(args)
    args.reward_config = reward_config(args)
    try:
        args.benchmarks = parse_benchmarks(args.data, args.samples)
    except ValueError as err:
        p.error(str(err))
    return args


# the settings without a --run (or that a run's file does not hold)
RUN_DEFAULTS = {"max_response_len": 4096, "max_prompt_length": 1024, "skip_bad_rows": False, "prompt_key": "problem",
                "answer_key": None, "instruction": DEFAULT_INSTRUCTION, "few_shot": (), "chat_template": None}


def run_prompt_settings(args: argparse.Namespace) -> None:
    """Fill the prompt and length settings not given here from the run's saved ones (``--run``), else the defaults."""
    saved = {}
    if args.run:
        path = RunDir(Path(args.run)).data / PROMPT_SETTINGS
        if path.is_file():
            saved = json.loads(path.read_text())
        else:
            print(f"note: {path} is missing (a run from before it was written): prompts are built from this "
                  "command's flags", flush=True)
    args.few_shot = None
    for key, default in RUN_DEFAULTS.items():
        if getattr(args, key) is None:
            value = saved.get(key) or default if key == "max_response_len" else saved.get(key, default)
            setattr(args, key, tuple(tuple(p) for p in value) if key == "few_shot" else value)


def checkpoint_dtype(hf_dir: Path) -> str:
    """The engine precision an HF export asks for: bfloat16 for a bf16 export, else float32 (config.json's "dtype",
    or "torch_dtype" of older writers)."""
    config = json.loads((Path(hf_dir) / "config.json").read_text())
    return "bfloat16" if (config.get("dtype") or config.get("torch_dtype")) == "bfloat16" else "float32"


def engine_factory(args: argparse.Namespace):
    """hf_dir -> Engine; the engine is built once and later checkpoints are swapped in with update_weights. Without
    --rollout-dtype it computes in the precision of the first checkpoint it serves (a run's exports share theirs; a
    server started in float32 would refuse a bf16 checkpoint's weights)."""
    from megamu.engines import build_engine

    cfg = engine_config(args)
    if args.rollout_dtype is None:
        return lambda hf_dir: build_engine(replace(cfg, dtype=checkpoint_dtype(hf_dir)), hf_dir)
    return lambda hf_dir: build_engine(cfg, hf_dir)


def reward_description(cfg: RewardConfig) -> str:
    """The reward as saved in a report's settings: a report is reused only for the same reward and options."""
    spec, kwargs = cfg.spec_and_kwargs()
    return spec + (f" {json.dumps(kwargs, sort_keys=True)}" if kwargs else "")


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    from transformers import AutoTokenizer

    from megamu.reward import make_scorer

    if args.run:
        checkpoints = run_checkpoints(args.run)
        out = Path(args.out or Path(args.run) / "eval")
    else:
        hf = Path(args.hf_dir)
        if not (hf / "config.json").is_file():
            raise SystemExit(f"--hf-dir {hf}: not an HF model folder (no config.json)")
        checkpoints = [Checkpoint(hf.resolve().name, hf, None, None)]
        out = Path(args.out or Path("eval") / hf.resolve().name)
    settings = EvalSettings(
        max_response_len=args.max_response_len, temperature=args.temperature, top_p=args.top_p, seed=args.seed,
        limit=args.limit, max_prompt_length=args.max_prompt_length,
        skip_bad_rows=args.skip_bad_rows, prompt_key=args.prompt_key,
        answer_key=args.answer_key, reward_fn=reward_description(args.reward_config), instruction=args.instruction,
        few_shot=args.few_shot, chat_template=args.chat_template,
    )
    # the training's reward pool: --reward-timeout, --reward-error-tolerance, --reward-workers ... as in training
    with make_scorer(args.reward_config) as scorer:
        summary = evaluate_checkpoints(
            checkpoints, engine_factory(args), AutoTokenizer.from_pretrained, scorer, args.benchmarks, settings, out,
            save_responses=args.save_responses, overwrite=args.overwrite,
        )
    print((out / "summary.md").read_text())
    print(f"reports in {out}/")
    return summary


if __name__ == "__main__":
    main()
