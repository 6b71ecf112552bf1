"""A finished fidelity run in one small JSON (issue 34): its key, config, held-out evaluations and per-update curves.

Run folders (~10 MB: metrics, logs) stay out of git; the summary is committed (docs/fidelity-4stage/runs/), so the
report can be regenerated (``--report-only``) and a later sitting skips every key that has one. Curves are the
per-update statistics of the trainer, aggregated over CURVE_POINTS windows of equal length: fractions by their mean
(a window's share of tokens / replies), the other statistics by their median (one minibatch holds few A < 0 tokens,
so single updates are noisy).
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass
from pathlib import Path

from megamu.observability.metrics import read_metrics

CURVE_POINTS = 64
# per-update statistics of the trainer (megamu.training.step, megamu.algo.loss / tail) kept in the summary
MEAN_KEYS = ("clip_fraction", "veto_token_fraction", "veto_sequence_fraction", "neg_adv_reply_below_tau")
MEDIAN_KEYS = ("ratio_neg_adv_mean", "neg_adv_log_ratio_p10", "log_ratio_min", "approx_kl", "entropy",
               "response_length_mean", "reward_mean")


def _finite(values) -> list[float]:
    return [float(v) for v in values if isinstance(v, (int, float)) and math.isfinite(v)]


def _agg(values: list, key: str) -> float | None:
    v = _finite(values)
    if not v:
        return None
    return statistics.fmean(v) if key in MEAN_KEYS else statistics.median(v)


def stage_end(stage_of_update: list[int], values: list) -> float | None:
    """The lowest over stages of the median of ``values`` over each stage's last quarter of updates (β is reset at
    each stage, so a drift shows at the end of the stage where it happens)."""
    by: dict[int, list] = {}
    for st, v in zip(stage_of_update, values):
        by.setdefault(st, []).append(v)
    ends = []
    for vs in by.values():
        tail = _finite(vs[-max(len(vs) // 4, 1):])
        if tail:
            ends.append(statistics.median(tail))
    return min(ends) if ends else None


def per_stage(ups: list[dict]) -> list[dict]:
    """Per stage: the median and max per-token KL to β, and the veto's rates (tokens and replies masked, A < 0
    replies below log τ) over all of its updates (Table 5 is per stage)."""
    out = []
    for st in sorted({r["stage"] for r in ups}):
        rs = [r for r in ups if r["stage"] == st]
        kl = _finite(r.get("approx_kl") for r in rs)
        out.append({"stage": st, "updates": len(rs), "kl_median": statistics.median(kl) if kl else None,
                    "kl_max": max(kl, default=None),
                    **{k: _agg([r.get(k) for r in rs], k) for k in MEAN_KEYS}})
    return out


def summarize(save: Path, key: str, config: dict, evals: list[dict], times: dict) -> dict:
    """The summary of the finished run in ``save`` (its metrics.jsonl) with the bench's evaluations."""
    rows = read_metrics(save)
    ups = sorted((r for r in rows if r["kind"] == "update"), key=lambda r: r["update"])
    n = len(ups)
    edges = [round(n * i / CURVE_POINTS) for i in range(CURVE_POINTS + 1)]
    spans = [(a, b) for a, b in zip(edges, edges[1:]) if b > a]
    curve: dict[str, list] = {"update": [ups[b - 1]["update"] for _, b in spans]}
    for k in (*MEAN_KEYS, *MEDIAN_KEYS):
        curve[k] = [_agg([r.get(k) for r in ups[a:b]], k) for a, b in spans]
    run_means = {k: _agg([r.get(k) for r in ups], k) for k in MEAN_KEYS}
    stages = [r for r in rows if r["kind"] == "stage"]
    # seconds since the trainer started; update records count from 0, so the export after u updates follows record u-1
    at = {r["update"] + 1: r["time"] for r in ups if "time" in r}
    evals = [{**e, "time": 0.0 if e["update"] == 0 else at.get(e["update"])} for e in evals]
    return {"key": key, "config": config, "updates_done": n, **times, "evals": evals, "curve": curve,
            "per_stage": per_stage(ups),
            "run_mean": run_means,
            "stage_end_ratio_neg_adv": stage_end([r["stage"] for r in ups], [r.get("ratio_neg_adv_mean") for r in ups]),
            "log_ratio_min": min(_finite(r.get("log_ratio_min") for r in ups), default=None),
            "approx_kl_max": max(_finite(r.get("approx_kl") for r in ups), default=None),
            "stage_truncation": [s.get("truncation_rate") for s in stages]}


def summary_path(folder: Path, key: str) -> Path:
    return folder / (key.replace("/", "__") + ".json")


def write_summary(folder: Path, summary: dict) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = summary_path(folder, summary["key"])
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(summary, indent=None, separators=(",", ":")) + "\n")
    tmp.replace(path)
    return path


@dataclass
class Run:
    """A summary as the report reads it: accuracies are sampled pass@1 unless named greedy."""

    s: dict

    def __getattr__(self, name: str):  # config fields: method, mu, stages, seed, lr, updates, ...
        if name == "s":  # not set yet (copy, unpickling): no recursion
            raise AttributeError(name)
        try:
            return self.s["config"][name]
        except KeyError:
            raise AttributeError(name) from None

    @property
    def n(self) -> int:
        return self.s["evals"][0]["n"]

    def acc(self, which: str = "sampled") -> list[float]:
        return [e[which] for e in self.s["evals"]]

    @property
    def base(self) -> float:
        return self.acc()[0]

    @property
    def final(self) -> float:
        return self.acc()[-1]

    @property
    def best(self) -> float:
        return max(self.acc()[1:]) if len(self.s["evals"]) > 1 else math.nan

    def greedy(self, what: str) -> float:
        g = self.acc("greedy")
        return g[-1] if what == "final" else max(g[1:]) if len(g) > 1 else math.nan

    @property
    def clip_fraction(self) -> float:
        v = self.s["run_mean"].get("clip_fraction")
        return math.nan if v is None else v

    @property
    def stage_end_ratio(self) -> float:
        v = self.s["stage_end_ratio_neg_adv"]
        return math.nan if v is None else v

    def series(self, key: str) -> tuple[list[int], list[float]]:
        c = self.s["curve"]
        return c["update"], [math.nan if v is None else v for v in c[key]]


def load_runs(folder: Path) -> list[Run]:
    return [Run(json.loads(p.read_text())) for p in sorted(folder.glob("*.json"))]
