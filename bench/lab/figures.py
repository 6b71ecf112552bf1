"""bench/fidelity.py's figures, in the paper's shape, from run summaries (bench/lab/summary.py): accuracy against
updates (sampled pass@1 solid, greedy dashed, as in the paper's Figs. 2-3) beside the per-update statistics that
explain it (clip fraction: Fig. 2; E[ρ|A<0] and its lower tail: Fig. 3 and §3.2; the veto's trigger rate).

Curves are the summaries' window aggregates (CURVE_POINTS windows per run), so no further smoothing is applied.
"""

from __future__ import annotations

import math
from pathlib import Path

from megamu.algo import REFERENCE_TAU

PANELS = (
    ("clip_fraction", "clip fraction (window mean)"),
    ("ratio_neg_adv_mean", "E[ρ | A < 0] (window median)"),
    ("neg_adv_log_ratio_p10", "10th pct of log ρ on A < 0 tokens"),
    ("neg_adv_reply_below_tau", "A < 0 replies with min log ρ < log τ"),
    ("veto_sequence_fraction", "veto sequence fraction"),
    ("entropy", "entropy (nats/token)"),
    ("response_length_mean", "response length (tokens)"),
)


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _name(r) -> str:
    return f"{r.method} μ={r.mu}x{r.stages} s{r.seed} lr {r.lr:g}"


def accuracy_panels(runs, path: Path, title: str) -> bool:
    """Accuracy and the per-update panels for ``runs`` (one colour per run); False (no file) without runs."""
    if not runs:
        return False
    plt = _plt()
    fig, axes = plt.subplots(2, 4, figsize=(15, 6.4))
    ax = axes.flat[0]
    for i, r in enumerate(runs):
        colour = f"C{i % 10}"
        ups = [e["update"] for e in r.s["evals"]]
        ax.plot(ups, r.acc("sampled"), marker=".", color=colour, label=_name(r))
        ax.plot(ups, r.acc("greedy"), linestyle="--", color=colour, linewidth=0.8)
        for axis, (key, _) in zip(axes.flat[1:], PANELS):
            xs, ys = r.series(key)
            axis.plot(xs, ys, color=colour, linewidth=1.1)
    ax.set_title(f"held-out pass@1, sampled (solid, k = {runs[0].k}) / greedy (dashed)", fontsize=8)
    for axis, (key, name) in zip(axes.flat[1:], PANELS):
        axis.set_title(name, fontsize=8)
        if key == "ratio_neg_adv_mean":
            axis.set_yscale("log")
            axis.axhline(1.0, color="grey", linewidth=0.6)
        if key == "neg_adv_log_ratio_p10":
            axis.axhline(math.log(REFERENCE_TAU), color="grey", linewidth=0.6, linestyle="--")
        if key == "clip_fraction":
            axis.set_yscale("symlog", linthresh=1e-5)
    for axis in axes.flat:
        axis.tick_params(labelsize=7)
        axis.set_xlabel("update", fontsize=7)
    axes.flat[0].legend(fontsize=6)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=72)
    plt.close(fig)
    return True


def _stage_lines(ax, updates: int, mu: int) -> None:
    """Stage boundaries (β and the rollout dataset are refreshed there) as thin vertical lines."""
    if mu >= updates or updates // mu > 16:  # one stage, or μ = 4: no boundary worth drawing
        return
    for b in range(mu, updates, mu):
        ax.axvline(b, color="grey", linewidth=0.5, linestyle=":")


def _band(ax, groups: dict, value, colour: str, label: str) -> None:
    """Seed mean (line) and the seeds' range (band) of ``value(run) -> (xs, ys)`` over one method's runs."""
    import statistics

    at: dict = {}  # x -> the seeds' values there (aligned by update: seeds may be evaluated at other spacings)
    for xs, ys in (value(r) for r in groups):
        for x, y in zip(xs, ys):
            if math.isfinite(y):
                at.setdefault(x, []).append(y)
    xs = sorted(at)
    ax.plot(xs, [statistics.fmean(at[x]) for x in xs], color=colour, label=label, linewidth=1.3)
    if len(groups) > 1:
        ax.fill_between(xs, [min(at[x]) for x in xs], [max(at[x]) for x in xs], color=colour, alpha=0.2,
                        linewidth=0)


def seed_mean_panels(by_method: dict[str, list], path: Path, title: str) -> bool:
    """Per method: the seeds' mean (line) and range (band) of held-out sampled pass@1, clip fraction, E[ρ|A<0],
    the 10th percentile of ρ on A < 0 tokens (log axis, τ marked) and the vetoed-token fraction, with the stage
    boundaries drawn; the legend gives each method's seed count."""
    by_method = {m: rs for m, rs in by_method.items() if rs}
    if not by_method:
        return False
    plt = _plt()
    fig, axes = plt.subplots(1, 5, figsize=(19, 3.8))
    panels = (
        ("sampled pass@1 (held out; mean, band = seeds' range)",
         lambda r: ([e["update"] for e in r.s["evals"]], r.acc("sampled")), None),
        ("clip fraction (window mean)", lambda r: r.series("clip_fraction"), "symlog"),
        ("E[ρ | A < 0] (window median)", lambda r: r.series("ratio_neg_adv_mean"), "log"),
        ("ρ tail: min over tokens (window median), log axis; τ dashed",
         lambda r: (r.series("log_ratio_min")[0],
                    [math.exp(v) if math.isfinite(v) else math.nan for v in r.series("log_ratio_min")[1]]),
         "log"),
        ("vetoed-token fraction (window mean)", lambda r: r.series("veto_token_fraction"), "symlog"),
    )
    for i, (method, runs) in enumerate(sorted(by_method.items())):
        colour = f"C{i % 10}"
        for ax, (_, value, _) in zip(axes, panels):
            _band(ax, runs, value, colour, f"{method} ({len(runs)} seed{'s' * (len(runs) > 1)})")
    every = [r for rs in by_method.values() for r in rs]
    staged_mu = max((r.mu for r in every if 4 < r.mu < r.updates), default=None)
    for ax, (name, _, scale) in zip(axes, panels):
        ax.set_title(name, fontsize=8)
        if staged_mu:
            _stage_lines(ax, every[0].updates, staged_mu)
        if scale == "symlog":
            ax.set_yscale("symlog", linthresh=1e-4)
            ax.set_ylim(bottom=0)
        elif scale == "log":
            ax.set_yscale("log")
        ax.tick_params(labelsize=7)
        ax.set_xlabel("update", fontsize=7)
    axes[2].axhline(1.0, color="grey", linewidth=0.6)
    axes[3].axhline(REFERENCE_TAU, color="grey", linewidth=0.6, linestyle="--")
    axes[0].legend(fontsize=6)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=72)
    plt.close(fig)
    return True


def staleness_curve(points: dict[str, dict[int, list]], path: Path, title: str) -> bool:
    """Last-stage mean against μ per stage (log axis), one line per rule through the seeds' means, each seed a dot."""
    import statistics

    from bench.lab.curves import last_stage_mean

    if not any(rs for per_mu in points.values() for rs in per_mu.values()):
        return False
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 4))
    for i, (rule, per_mu) in enumerate(points.items()):
        mus = sorted(m for m, rs in per_mu.items() if rs)
        vals = {m: [last_stage_mean(r) for r in per_mu[m]] for m in mus}
        ax.plot(mus, [statistics.fmean(vals[m]) for m in mus], color=f"C{i}", marker="o", label=rule)
        for m in mus:
            ax.scatter([m] * len(vals[m]), vals[m], color=f"C{i}", s=10, alpha=0.5)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("μ: updates per stage (staleness)", fontsize=8)
    ax.set_ylabel("last-stage mean, sampled pass@1", fontsize=8)
    ax.legend(fontsize=7)
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=72)
    plt.close(fig)
    return True
