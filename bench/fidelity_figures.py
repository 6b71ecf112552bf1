"""bench/fidelity.py's figures, in the paper's shape: Fig. 2 (clip fraction and accuracy, [0.8, 1.2] against [0, 5]),
Fig. 3 (accuracy and E[ρ|A<0] per veto scope), the per-update statistics, the staleness curve and the lr sweep.

Per-update series are smoothed by a centred running median (one minibatch of 2 x 8 samples holds few A < 0 tokens,
so single updates are noisy); the window is a 64th of the run, drawn in the figure titles.
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def smooth(ys: list[float], window: int) -> list[float]:
    """Centred running median over the finite values in each window (NaN where the window has none)."""
    out, h = [], window // 2
    for i in range(len(ys)):
        w = [v for v in ys[max(0, i - h):i + h + 1] if math.isfinite(v)]
        out.append(statistics.median(w) if w else math.nan)
    return out


def _window(runs) -> int:
    return max(max((r.updates for r in runs), default=1) // 64, 1)


def _ratio_axis(ax) -> None:
    from matplotlib.ticker import FormatStrFormatter, LogLocator, NullFormatter

    ax.set_yscale("log")
    ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 3.0, 5.0, 7.0, 8.0, 9.0)))  # 0.8, 0.9 labelled
    ax.yaxis.set_major_formatter(FormatStrFormatter("%g"))
    ax.yaxis.set_minor_formatter(NullFormatter())
    ax.axhline(1.0, color="grey", linewidth=0.6)


def _accuracy(ax, runs) -> None:
    for r in runs:
        ax.plot([e["update"] for e in r.evals], [e["accuracy"] for e in r.evals], marker=".", label=_name(r))
    ax.set_title(f"held-out greedy accuracy ({runs[0].n} problems)", fontsize=9)


def _series(ax, runs, key: str, title: str, window: int) -> None:
    for r in runs:
        ys = smooth(r.series[key], window)
        ax.plot(range(1, len(ys) + 1), ys, linewidth=1.1, label=_name(r))
    ax.set_title(f"{title} (running median, {window})", fontsize=9)


def _name(r) -> str:
    return f"{r.method} μ={r.mu}" + (f" s{r.seed}" if r.seed != 1 else "")


def _finish(fig, axes, path: Path, title: str) -> None:
    for ax in axes:
        ax.tick_params(labelsize=7)
        ax.set_xlabel("update", fontsize=7)
    axes[0].legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=72)
    _plt().close(fig)


def fig2(runs, path: Path) -> bool:
    """Clip fraction, held-out accuracy and held-out truncation: clip [0.8, 1.2] against [0, 5] (paper Fig. 2)."""
    if not runs:
        return False
    plt = _plt()
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    _series(axes[0], runs, "clip_fraction", "clip fraction", _window(runs))
    _accuracy(axes[1], runs)
    for r in runs:
        axes[2].plot([e["update"] for e in r.evals], [e["truncated"] for e in r.evals], marker=".", label=_name(r))
    axes[2].set_title("held-out replies that never stop (greedy)", fontsize=9)
    _finish(fig, list(axes), path, "clip [0.8, 1.2] vs [0, 5] at the same staleness (cf. paper Fig. 2)")
    return True


def fig3(runs, path: Path, title: str = "veto scopes under clip [0, 5] (cf. paper Fig. 3)") -> bool:
    """Held-out accuracy and E[ρ|A<0] for each veto scope (paper Fig. 3)."""
    if not runs:
        return False
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(12, 3.8))
    _accuracy(axes[0], runs)
    _series(axes[1], runs, "ratio_neg_adv_mean", "E[ρ | A < 0]", _window(runs))
    _ratio_axis(axes[1])
    _finish(fig, list(axes), path, title)
    return True


def per_update(runs, panels, path: Path, title: str) -> bool:
    if not runs:
        return False
    plt = _plt()
    fig, axes = plt.subplots(2, 4, figsize=(14, 6))
    window = _window(runs)
    for ax, (key, name) in zip(axes.flat, panels):
        _series(ax, runs, key, name, window)
        if key == "ratio_neg_adv_mean":
            _ratio_axis(ax)
        if key == "log_ratio_min":
            ax.axhline(math.log(1e-4), color="grey", linewidth=0.6, linestyle="--")
    _finish(fig, list(axes.flat), path, title)
    return True


def staleness_curve(groups: dict, methods, low_mu: int, path: Path) -> bool:
    """Final and best held-out accuracy against μ at the same samples; standard GRPO at μ = low_mu as a line."""
    points = {m: sorted((mu, g) for (name, mu), g in groups.items() if name == m) for m in methods}
    if max(len(v) for v in points.values()) < 2:  # a curve needs one method at two μ at least
        return False
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.6))
    for ax, what in zip(axes, ("final", "best")):
        for m, pts in points.items():
            if pts:
                ax.errorbar([mu for mu, _ in pts], [getattr(g, what) for _, g in pts],
                            yerr=[2 * g.se for _, g in pts], marker="o", capsize=3, label=m)
        ref = groups.get(("grpo", low_mu))
        if ref is not None:
            ax.axhline(getattr(ref, what), color="grey", linestyle="--", label=f"grpo μ={low_mu}")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("μ (updates per rollout stage)", fontsize=8)
        ax.set_title(f"{what} held-out accuracy (± 2 SE)", fontsize=9)
        ax.tick_params(labelsize=7)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=72)
    plt.close(fig)
    return True


def sweep(runs, path: Path) -> bool:
    if not runs:
        return False
    plt = _plt()
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    window = _window(runs)
    for r in sorted(runs, key=lambda r: r.lr):
        axes[0].plot([e["update"] for e in r.evals], [e["accuracy"] for e in r.evals], marker=".", label=f"lr {r.lr:g}")
        for ax, key in zip(axes[1:], ("approx_kl", "entropy")):
            ys = smooth(r.series[key], window)
            ax.plot(range(1, len(ys) + 1), ys, linewidth=1.1, label=f"lr {r.lr:g}")
    axes[0].set_title("grpo μ=4: held-out greedy accuracy", fontsize=9)
    axes[1].set_title(f"approx KL(β ‖ π_θ) (running median, {window})", fontsize=9)
    axes[2].set_title(f"entropy (running median, {window})", fontsize=9)
    _finish(fig, list(axes), path, "learning-rate sweep: standard GRPO at μ = 4")
    return True
