"""Curves, not two points (issue 42): what the lab's report reads off a run's whole evaluation curve and its
per-stage statistics, beside best and final.

- *last-stage mean*: the mean of the evaluations in the last quarter of the run's updates (the final stage of a
  4-stage run; μ = 4 and single-stage runs are read on the same window of samples),
- *area*: the mean of every evaluation after update 0 (the area under the curve over its length),
- *min*: the lowest evaluation after update 0 (a run that swings shows it here),
- per stage: median and max per-token KL to β, vetoed tokens, replies masked, A < 0 replies below log τ.

Every function takes ``summary.Run`` objects and returns numbers; nothing here decides a verdict.
"""

from __future__ import annotations

import hashlib
import json
import math
import statistics

LAST_WINDOW = 0.25  # the last quarter of the updates: the final stage of the 4-stage schedule


def post_base(r, which: str = "sampled") -> list[tuple[int, float]]:
    return [(e["update"], e[which]) for e in r.s["evals"] if e["update"] > 0]


def last_stage_mean(r, which: str = "sampled") -> float:
    start = r.updates * (1 - LAST_WINDOW)
    vals = [v for u, v in post_base(r, which) if u > start]
    return statistics.fmean(vals) if vals else math.nan


def area(r, which: str = "sampled") -> float:
    vals = [v for _, v in post_base(r, which)]
    return statistics.fmean(vals) if vals else math.nan


def minimum(r, which: str = "sampled") -> float:
    return min((v for _, v in post_base(r, which)), default=math.nan)


def last_window_evals(r) -> int:
    start = r.updates * (1 - LAST_WINDOW)
    return sum(1 for u, _ in post_base(r) if u > start)


def se_window(p: float, r, evals: int) -> float:
    """Sampling SE of the mean of ``evals`` evaluations at accuracy ``p``: n problems x k samples each, treated as
    independent across evaluations (each evaluation draws its own samples from another checkpoint)."""
    p = min(max(p, 1e-3), 1 - 1e-3)
    return math.sqrt(p * (1 - p) / (r.n * r.k * max(evals, 1)))


def stage_rows(r) -> list[dict]:
    """Per-stage statistics: exact from the summary's ``per_stage`` (summaries written since issue 42), else from the
    per-update curve's equal windows (medians of window medians, max of window medians: marked ``approx``). A run
    of more than 4 stages (μ = 4) is read in 4 quarters, the windows of the 4-stage runs."""
    if r.s.get("per_stage") and r.stages <= 4:
        return [{**x, "approx": False} for x in r.s["per_stage"]]
    xs, _ = r.series("approx_kl")
    stages = min(max(r.stages, 1), 4)
    per = len(xs) // stages if stages <= len(xs) else 1
    out = []
    for st in range(min(stages, len(xs))):
        def vals(key: str, window: slice = slice(st * per, (st + 1) * per)) -> list[float]:
            return [v for v in r.series(key)[1][window] if math.isfinite(v)]

        kl = vals("approx_kl")
        row = {"stage": st, "approx": True, "kl_median": statistics.median(kl) if kl else None,
               "kl_max": max(kl, default=None)}
        for key in ("clip_fraction", "veto_token_fraction", "veto_sequence_fraction", "neg_adv_reply_below_tau"):
            v = vals(key)
            row[key] = statistics.fmean(v) if v else None
        out.append(row)
    return out


def fingerprint(r) -> str:
    """Identical evaluations and curves: the same run under two keys (e.g. τ = 1e-6 where the veto never fires is
    bit-identical to no veto), to be counted once."""
    # the τ-dependent diagnostics differ between such twins though the training is the same: left out
    tau_dependent = ("veto_token_fraction", "veto_sequence_fraction", "neg_adv_reply_below_tau")
    body = {"evals": [{k: e.get(k) for k in ("update", "sampled", "greedy")} for e in r.s["evals"]],
            "curve": {k: v for k, v in (r.s.get("curve") or {}).items() if k not in tau_dependent}}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def deduplicated(runs: list) -> tuple[list, dict[str, str]]:
    """(runs with each duplicate kept once, {dropped key: the key it duplicates}). The run of the shortest method
    name is kept (the plain method over an ablation that reproduced it: `grpo-relaxed` over `mu-grpo-tau1e-6`);
    the report names both."""
    seen: dict[str, str] = {}
    kept, dropped = [], {}
    for r in sorted(runs, key=lambda r: (len(r.method), r.s["key"])):
        fp = fingerprint(r)
        if fp in seen:
            dropped[r.s["key"]] = seen[fp]
        else:
            seen[fp] = r.s["key"]
            kept.append(r)
    return kept, dropped


def time_to(r, target: float) -> float | None:
    """The trainer's wall-clock (s since it started: rollout, training and syncs) at the first evaluation whose
    sampled accuracy reaches ``target``; None when none does or the summary has no times (before issue 42)."""
    for e in r.s["evals"]:
        if e["update"] > 0 and e["sampled"] >= target:
            return e.get("time")
    return None


def paired(xs: list, ys: list, fn) -> list[tuple[int, float]]:
    """(seed, fn(x) - fn(y)) for the seeds both lists have."""
    by = {y.seed: y for y in ys}
    return [(x.seed, fn(x) - fn(by[x.seed])) for x in xs if x.seed in by]
