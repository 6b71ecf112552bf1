"""A full μ-GRPO ``train_step`` vs a bare forward + backward + AdamW step of the same model on the same batch.

Both run in one process, interleaved (so load on a shared machine hits both alike), on the same parameters and the same
AdamW state. The baseline is the least a trainer must do: one forward over the same micro-batches, a token-mean
cross-entropy on the response tokens, backward, and ``torch.optim.AdamW.step``. ``train_step`` adds packing, the
temperature-scaled log-probs, the entropy metric, the clipped surrogate with the veto, statistics, the grad-norm and
clipping. Prints tokens/s of each, their ratio (goal >= 0.9) and peak RSS against 16 bytes/parameter
(fp32 weights + grads + two Adam moments).

    python bench/train_step.py [--model smollm2|tiny] [--samples 8] [--prompt-len 64] [--response-len 192]
                               [--micro-batch-size 4] [--iters 3] [--threads 1] [--only train_step|bare]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads OpenMP: no spinning on a shared machine
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megamu import parallel  # noqa: E402
from megamu.algo import ALGORITHM_PRESETS, group_advantages  # noqa: E402
from megamu.convert.checkpoint import load_hf_into_model  # noqa: E402
from megamu.model import ModelArch, build_model, token_logprobs  # noqa: E402
from megamu.records import RolloutSample  # noqa: E402
from megamu.training import OptimizerConfig, build_optimizer, compute_logprobs, pack, train_step  # noqa: E402
from megamu.training.batch import split_micro_batches  # noqa: E402


def rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2  # ru_maxrss is KiB on Linux


def hf_dir(name: str) -> Path:
    if name == "smollm2":
        from megamu.demo_model import smollm2_hf_dir

        return smollm2_hf_dir()
    from megamu.tiny import save_tiny_model

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
        logits = model(ids, pos, None)[:, batch.first_column : -1]
        logp, _ = token_logprobs(logits, ids[:, batch.first_column + 1 :])
        (-(logp * batch.response_mask).sum() / n_tok).backward()
    adamw.step()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=("smollm2", "tiny"), default="smollm2")
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--response-len", type=int, default=192)
    ap.add_argument("--micro-batch-size", type=int, default=4)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--only", choices=("train_step", "bare"), help="run one side only (to attribute peak RSS)")
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
    sides = {
        "train_step": lambda: train_step(model, opt, samples, algo, micro_batch_size=args.micro_batch_size),
        "bare": lambda: bare_step(model, opt.opt, samples, args.micro_batch_size),
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
    if len(sides) == 2:
        result["ratio_train_step_over_bare_cpu_best"] = best["bare"] / best["train_step"]
        result["ratio_train_step_over_bare_wall_median"] = med["bare"] / med["train_step"]
    print(json.dumps(result, indent=2))
    parallel.destroy_distributed()


if __name__ == "__main__":
    main()
