"""The μ-GRPO update with and without prompt sharing, and against a bare forward + backward + AdamW step.

All sides run in one process, interleaved (so load on a shared machine hits them alike), on the same parameters, the
same AdamW state and the same minibatch (by default the CPU demo's shape: groups of 8 samples of one ~90-token
prompt with ~25-token replies, 4 groups per update, micro-batches of 8):

- ``shared``: ``train_step(share_prompts=True)``: each group's prompt forwarded once, output layer at response
  positions only, entropy from the loss's log-softmax (what the local spec trains with now);
- ``per_sample``: ``train_step`` with one row per sample (the GPU path's layout), same output-layer and entropy code;
- ``bare``: the least a trainer must do: one forward over per-sample rows, a token-mean cross-entropy on the response
  tokens, backward, ``torch.optim.AdamW.step``.

Prints tokens/s of each (every token of the minibatch, prompts included, as the trainer reports), the ratios, and peak
RSS against 16 bytes/parameter (fp32 weights + grads + two Adam moments).

    python -m bench.train_step [--model smollm2|tiny] [--samples 32] [--group 8] [--prompt-len 90]
                               [--response-len 32] [--micro-batch-size 8] [--iters 2] [--threads 2]
                               [--only shared|per_sample|bare]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads OpenMP: no spinning on a shared machine
import torch

from megamu.algo import ALGORITHM_PRESETS, group_advantages
from megamu.convert.checkpoint import load_hf_into_model
from megamu.model import ModelArch, build_model, token_logprobs
from megamu.rollout.records import RolloutSample
from megamu.runtime import parallel
from megamu.training import OptimizerConfig, build_optimizer, compute_logprobs, pack, train_step
from megamu.training.batch import split_micro_batches

SIDES = ("shared", "per_sample", "bare")


def rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2  # ru_maxrss is KiB on Linux


def hf_dir(name: str) -> Path:
    if name == "smollm2":
        from megamu.model.demo_model import smollm2_hf_dir

        return smollm2_hf_dir()
    from tests.tiny import save_tiny_model

    return save_tiny_model(Path(tempfile.mkdtemp()) / "tiny", "llama", hidden_size=256, intermediate_size=768,
                           num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4)


def make_batch(model, vocab: int, n: int, prompt_len: int, response_len: int, group: int) -> list[RolloutSample]:
    g = torch.Generator().manual_seed(0)
    n_groups = max(1, n // group)
    rewards = torch.randint(0, 2, (n_groups, group), generator=g).float()
    adv = group_advantages(rewards)
    samples = []
    for i in range(n_groups):
        prompt = torch.randint(10, vocab, (prompt_len,), generator=g).tolist()
        for j in range(group):
            length = int(torch.randint(response_len // 2, response_len + 1, (1,), generator=g))
            resp = torch.randint(10, vocab, (length,), generator=g).tolist()
            samples.append(RolloutSample(i, j, prompt, resp, [0.0] * length, float(rewards[i, j]),
                                         float(adv[i, j]), "stop"))
    for s, lp in zip(samples, compute_logprobs(model, samples, micro_batch_size=4)):
        s.behaviour_logprobs = [x + 0.1 for x in lp]  # ratios e^-0.1: real work for clip and veto, nothing vetoed
    return samples


def bare_step(model, adamw: torch.optim.Optimizer, samples, micro_batch_size: int) -> None:
    """The baseline: forward, response-token cross-entropy, backward, AdamW. Same micro-batches, same parameters."""
    adamw.zero_grad(set_to_none=True)
    n_tok = sum(s.response_length for s in samples)
    ordered = sorted(samples, key=lambda s: len(s.prompt_ids) + s.response_length)  # train_step's padding, too
    for mb in split_micro_batches(ordered, micro_batch_size):
        batch = pack(mb)
        ids = batch.input_ids
        pos = torch.arange(ids.shape[1]).unsqueeze(0).expand_as(ids)
        logits = model(ids, pos, None).flatten(0, 1)[batch.score_index]
        logp, _ = token_logprobs(logits, batch.targets)
        (-(logp * batch.response_mask).sum() / n_tok).backward()
    adamw.step()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=("smollm2", "tiny"), default="smollm2")
    ap.add_argument("--samples", type=int, default=32)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=90)
    ap.add_argument("--response-len", type=int, default=32, help="responses of uniform length in [len/2, len]")
    ap.add_argument("--micro-batch-size", type=int, default=8)
    ap.add_argument("--iters", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--only", choices=SIDES, help="run one side only (to attribute peak RSS)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    parallel.init_distributed(tensor_model_parallel_size=1)
    src = hf_dir(args.model)
    arch = ModelArch.from_hf(src)
    model = build_model(arch)
    load_hf_into_model(model, arch, src)
    n_params = sum(p.numel() for p in model.parameters())
    rss_model = rss_gib()
    samples = make_batch(model, arch.vocab_size, args.samples, args.prompt_len, args.response_len, args.group)
    tokens = sum(len(s.prompt_ids) + s.response_length for s in samples)
    opt = build_optimizer(model, OptimizerConfig(lr=1e-7, clip_grad=1.0))
    algo = ALGORITHM_PRESETS["mu-grpo"]

    # warm-up (allocator, AdamW state), then interleave so that load on a shared machine hits both alike
    mbs = args.micro_batch_size
    sides = {
        "shared": lambda: train_step(model, opt, samples, algo, micro_batch_size=mbs, share_prompts=True),
        "per_sample": lambda: train_step(model, opt, samples, algo, micro_batch_size=mbs),
        "bare": lambda: bare_step(model, opt.opt, samples, mbs),
    }
    if args.only:
        sides = {args.only: sides[args.only]}
    wall: dict[str, list[float]] = {k: [] for k in sides}
    cpu: dict[str, list[float]] = {k: [] for k in sides}
    for it in range(args.iters + 1):
        for name, run in sides.items():
            t0, c0 = time.perf_counter(), time.process_time()
            run()
            if it:
                wall[name].append(time.perf_counter() - t0)
                cpu[name].append(time.process_time() - c0)

    # CPU seconds of this process are what other tenants of a shared machine disturb least; the minimum over
    # iterations is the least-disturbed run. Wall-clock medians are printed too.
    best = {k: min(v) for k, v in cpu.items()}
    med = {k: statistics.median(v) for k, v in wall.items()}
    result = {
        "model": args.model,
        "parameters": n_params,
        "tokens_per_step": tokens,
        "response_tokens_per_step": sum(s.response_length for s in samples),
        **{f"{k}_tokens_per_cpu_s_best": tokens / v for k, v in best.items()},
        "wall_s": {k: [round(x, 3) for x in v] for k, v in wall.items()},
        "cpu_s": {k: [round(x, 3) for x in v] for k, v in cpu.items()},
        "peak_rss_gib": rss_gib(),
        "rss_after_model_load_gib": rss_model,
        "peak_rss_over_16_bytes_per_param": rss_gib() * 1024**3 / (16 * n_params),
        "threads": args.threads,
    }
    for a, b in (("shared", "per_sample"), ("shared", "bare"), ("per_sample", "bare")):
        if a in sides and b in sides:  # speed-up of a over b: time of b / time of a
            result[f"ratio_{a}_over_{b}_cpu_best"] = round(best[b] / best[a], 3)
            result[f"ratio_{a}_over_{b}_wall_median"] = round(med[b] / med[a], 3)
    print(json.dumps(result, indent=2))
    parallel.destroy_distributed()


if __name__ == "__main__":
    main()
