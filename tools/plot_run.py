#!/usr/bin/env python
"""Plot a run: accuracy vs wall-clock, training reward per update, veto fraction and E[rho | A<0] per update.

    python tools/plot_run.py runs/my-run [--out runs/my-run/plots]

Reads ``RUN/metrics.jsonl`` and, when present, the evaluation reports ``RUN/eval/*.json`` of ``tools/evaluate.py
--run RUN`` (without them, accuracy comes from the trainer's held-out "eval" records, if any). The figures mirror
the paper's Figures 1, 3, 5 and 6 for your own run.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runnable as a script from a checkout

import matplotlib  # noqa: E402

matplotlib.use("Agg")  # files only: no display on clusters or CI
import matplotlib.pyplot as plt  # noqa: E402

from megamu.evaluation.run import read_metrics, update_records  # noqa: E402


def smooth(values: list[float], window: int) -> list[float]:
    """Trailing moving average (the bold lines of Fig. 5); the first points average what exists so far."""
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v
        if i >= window:
            acc -= values[i - window]
        out.append(acc / min(i + 1, window))
    return out


def smoothing_window(n: int) -> int:
    """The moving average's width for n points: a twentieth of the run, at least 4 points (a demo's 32 updates are
    averaged over 4, a paper run's 4096 over 204), never more than the run."""
    return max(1, min(n, max(4, n // 20)))


def time_axis(seconds: list[float]) -> tuple[list[float], str]:
    """Wall-clock values and their axis label: minutes for a run of up to two hours, hours beyond."""
    if max(seconds, default=0.0) <= 2 * 3600:
        return [t / 60 for t in seconds], "wall-clock (minutes)"
    return [t / 3600 for t in seconds], "wall-clock (hours)"


def stage_starts(updates: list[dict]) -> list[int]:
    """Update indices at which a new stage begins (rollout refreshes), excluding the first stage."""
    return [b["update"] for a, b in zip(updates, updates[1:]) if b.get("stage") != a.get("stage")]


def _series(updates: list[dict], key: str) -> tuple[list[int], list[float]]:
    pts = [(r["update"], float(r[key])) for r in updates if isinstance(r.get(key), (int, float))]
    return [p[0] for p in pts], [p[1] for p in pts]


def _stage_lines(ax, starts: list[int]) -> None:
    for i, u in enumerate(starts):
        ax.axvline(u, color="grey", linestyle="--", linewidth=0.8, label="rollout refresh" if i == 0 else None)


def plot_reward(updates: list[dict], out: Path) -> Path | None:
    x, y = _series(updates, "reward_mean")
    if not x:
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(x, y, color="tab:blue", alpha=0.3, linewidth=0.8)
    window = smoothing_window(len(y))
    ax.plot(x, smooth(y, window), color="tab:blue", linewidth=2, label=f"reward (mean of the last {window} updates)")
    # Too many refreshes (GRPO mu=4 has 1024) would paint the plot grey: mark them only when they are few.
    starts = stage_starts(updates)
    if len(starts) <= 64:
        _stage_lines(ax, starts)
    ax.set(xlabel="update", ylabel="training reward (mean over the minibatch)", title="Training reward per update")
    ax.legend()
    return _save(fig, out / "reward.png")


def plot_stability(updates: list[dict], out: Path) -> Path | None:
    """Veto fractions (Fig. 6 / App. C.1) and E[rho | A<0] (Fig. 3, the negative-advantage drift signal)."""
    panels = [
        ("negative-advantage veto", [("veto_token_fraction", "tokens vetoed"),
                                     ("veto_sequence_fraction", "sequences vetoed")], "fraction"),
        ("E[rho | A<0]", [("ratio_neg_adv_mean", "E[rho | A<0]")], "importance ratio"),
    ]
    present = [(t, [(k, lbl) for k, lbl in keys if _series(updates, k)[0]], yl) for t, keys, yl in panels]
    present = [p for p in present if p[1]]
    if not present:
        return None
    fig, axes = plt.subplots(len(present), 1, figsize=(7, 3.2 * len(present)), sharex=True, squeeze=False)
    starts = stage_starts(updates)
    for ax, (title, keys, ylabel) in zip(axes[:, 0], present):
        for key, label in keys:
            x, y = _series(updates, key)
            ax.plot(x, y, linewidth=1, label=label)
        if title.startswith("E[rho"):
            ax.axhline(1.0, color="black", linewidth=0.6)
        if len(starts) <= 64:
            _stage_lines(ax, starts)
        ax.set(title=title, ylabel=ylabel)
        ax.legend(fontsize=8)
    axes[-1, 0].set_xlabel("update")
    return _save(fig, out / "stability.png")


def load_eval_reports(run: Path) -> list[dict]:
    """Per-checkpoint reports of ``tools/evaluate.py --run`` that know their wall-clock time, in time order."""
    reports = []
    for path in sorted((run / "eval").glob("*.json")):
        if path.name == "summary.json":
            continue
        try:
            r = json.loads(path.read_text())
        except json.JSONDecodeError:
            print(f"warning: {path}: not valid JSON, skipped", file=sys.stderr)
            continue
        if isinstance(r, dict) and r.get("time") is not None and "benchmarks" in r:
            reports.append(r)
    return sorted(reports, key=lambda r: r["time"])


def plot_accuracy(reports: list[dict], metrics: list[dict], out: Path) -> Path | None:
    """Benchmark accuracy of the evaluated checkpoints; without reports, the trainer's own held-out evaluations."""
    held_out = sorted((r for r in metrics if r.get("kind") == "eval" and "accuracy" in r), key=lambda r: r["time"])
    if not reports and not held_out:
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    if reports:
        times, xlabel = time_axis([r["time"] for r in reports])
        for name in reports[0]["benchmarks"]:
            ax.plot(times, [100 * r["benchmarks"][name]["mean"] for r in reports], marker=".", linewidth=1, label=name)
        ax.plot(times, [100 * r["average"] for r in reports], marker="o", color="black", linewidth=2, label="average")
        ylabel = "pass@1 averaged over k samples (%)"
    else:
        times, xlabel = time_axis([r["time"] for r in held_out])
        ax.plot(times, [100 * r["accuracy"] for r in held_out], marker="o",
                label="held-out prompts (greedy, logged by the trainer)")
        ylabel = "accuracy (%)"
    ax.set(xlabel=xlabel, ylabel=ylabel, title="Accuracy vs wall-clock")
    ax.legend(fontsize=8)
    return _save(fig, out / "accuracy_vs_time.png")


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    tmp = path.with_name(path.stem + ".tmp.png")
    fig.savefig(tmp, dpi=120)
    plt.close(fig)
    tmp.replace(path)
    return path


def main(argv: list[str] | None = None) -> list[Path]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run", help="the run's --save dir (holds metrics.jsonl)")
    p.add_argument("--out", default=None, help="where to write the PNGs (default RUN/plots)")
    args = p.parse_args(argv)
    run = Path(args.run)
    if not (run / "metrics.jsonl").is_file():
        p.error(f"{run}/metrics.jsonl not found: is {run} a run's --save dir?")
    out = Path(args.out) if args.out else run / "plots"
    out.mkdir(parents=True, exist_ok=True)
    metrics = read_metrics(run)
    updates = update_records(metrics)
    written = []
    for what, path in (("reward per update", plot_reward(updates, out)),
                       ("veto / E[rho|A<0] per update", plot_stability(updates, out)),
                       ("accuracy vs wall-clock", plot_accuracy(load_eval_reports(run), metrics, out))):
        if path is None:
            print(f"{what}: no data in {run}, skipped")
        else:
            print(f"{what}: {path}")
            written.append(path)
    return written


if __name__ == "__main__":
    main()
