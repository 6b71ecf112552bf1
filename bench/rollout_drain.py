"""Rollout phase samples/s: the call-by-call loop (before) vs the phase that never drains (after), side by side.

Before = what run_rollout_phase did until now: per ``shards_per_call`` shards, one synchronous ``generate`` call,
then scoring, then writing; the servers idle while the slowest request of a call finishes and while rewards are
scored. After = run_rollout_phase now: with SGLang, a bounded number of requests in flight across shard boundaries,
each shard scored and written as its last group lands; with LocalEngine, the next call generates while the last is
scored. Same prompts, seeds and engine for both; runs alternate (before, after, before, after ...) and the medians are
compared. Reply lengths vary (a few stop tokens), as real replies do, so that the tail of each call shows.

    python bench/rollout_drain.py [--engine sglang|local|both] [--prompts 128] [--repeats 2]
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megamu.data.prompts import PromptRecord  # noqa: E402
from megamu.engines.local import LocalEngine  # noqa: E402
from megamu.engines.types import SamplingParams  # noqa: E402
from megamu.reward import RewardScorer  # noqa: E402
from megamu.rollout.dataset import write_shard  # noqa: E402
from megamu.rollout.phase import generate_groups, run_rollout_phase  # noqa: E402
from megamu.tiny import build_char_tokenizer, save_tiny_model  # noqa: E402


def call_by_call(engine, prompts, out: Path, *, sampling, n, scorer, tok, groups_per_shard, shards_per_call):
    """The phase loop before this change: generate a call's shards, then score, then write; repeat."""
    out.mkdir(parents=True)
    chunks = [prompts[i : i + groups_per_shard] for i in range(0, len(prompts), groups_per_shard)]
    for c in range(0, len(chunks), shards_per_call):
        call = list(range(c, min(c + shards_per_call, len(chunks))))
        groups = generate_groups(engine, [p for k in call for p in chunks[k]], sampling, n, scorer, tok)
        for k in call:
            shard, groups = groups[: len(chunks[k])], groups[len(chunks[k]) :]
            write_shard(out, k, shard, t_generate_s=0.0)


class GenerateOnly:
    """An engine seen through generate() alone (the before-loop never used anything else)."""

    def __init__(self, engine):
        self.generate, self.name = engine.generate, engine.name


def measure(engine, prompts, work: Path, args, scorer, tok) -> dict:
    sampling = SamplingParams(temperature=1.0, max_new_tokens=args.new_tokens, seed=1,
                              stop_token_ids=args.stop_ids)
    n_samples = len(prompts) * args.n
    before, after = [], []
    for r in range(args.repeats):
        for label, runs in (("before", before), ("after", after)):
            out = work / f"{label}_{r}"
            t = time.monotonic()
            if label == "before":
                call_by_call(GenerateOnly(engine), prompts, out, sampling=sampling, n=args.n, scorer=scorer, tok=tok,
                             groups_per_shard=args.groups_per_shard, shards_per_call=args.shards_per_call)
            else:
                run_rollout_phase(engine, prompts, out, sampling=sampling, n_samples=args.n, scorer=scorer,
                                  tokenizer=tok, stage=0, groups_per_shard=args.groups_per_shard,
                                  shards_per_call=args.shards_per_call)
            runs.append(n_samples / (time.monotonic() - t))
            shutil.rmtree(out)
            print(f"  {label} {r}: {runs[-1]:.1f} samples/s", flush=True)
    b, a = statistics.median(before), statistics.median(after)
    return dict(before_samples_s=b, after_samples_s=a, after_over_before=a / b)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--engine", choices=["sglang", "local", "both"], default="both")
    ap.add_argument("--prompts", type=int, default=128)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--groups-per-shard", type=int, default=8)
    ap.add_argument("--shards-per-call", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--port", type=int, default=39600)
    args = ap.parse_args()
    torch.set_num_threads(1)
    tok = build_char_tokenizer()
    args.stop_ids = [tok.convert_tokens_to_ids(c) for c in "e .\n"]  # ~4% per token: lengths from 1 to the limit
    rng = random.Random(0)
    prompts = [PromptRecord(i, [rng.randrange(4, len(tok)) for _ in range(rng.randrange(8, 40))], "7", "")
               for i in range(args.prompts)]
    work = Path(tempfile.mkdtemp(prefix="megamu-drain-bench-"))
    model_dir = str(save_tiny_model(work / "tiny", "llama", seed=0))
    results = dict(prompts=args.prompts, n=args.n, new_tokens=args.new_tokens, groups_per_shard=args.groups_per_shard,
                   shards_per_call=args.shards_per_call)
    with RewardScorer(num_workers=1) as scorer:
        if args.engine in ("local", "both"):
            print("local engine:", flush=True)
            results["local"] = measure(LocalEngine(model_dir, max_batch_size=64), prompts, work, args, scorer, tok)
        if args.engine in ("sglang", "both"):
            from megamu.engines.sglang.client import SGLangEngine
            from tests.sglang_real.cpu_server import cpu_config

            engine = SGLangEngine(model_dir, cpu_config(args.port, work / "logs", server_concurrency=64))
            try:
                print("sglang (real CPU server):", flush=True)
                results["sglang"] = measure(engine, prompts, work, args, scorer, tok)
            finally:
                engine.shutdown()
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
