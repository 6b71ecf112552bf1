"""bench/fidelity.py's figures, in the paper's shape, from run summaries (bench/fidelity_summary.py): accuracy against
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
