"""bench/fidelity.py's report: the table, the per-update figures and the per-claim verdicts, from the runs' metrics.

Every number comes from the runs' own metrics.jsonl and rollout manifests; the verdict rules are stated in the
report next to the verdicts, so a reader can check them against the table.
"""

from __future__ import annotations

import json
import math
import os
import platform
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

from megamu.metrics import read_metrics

# per-update metrics plotted, with their panel titles (megamu.training.step.train_step / megamu.algo.policy_loss)
PANELS = (
    ("reward_mean", "minibatch reward (β's samples)"),
    ("ratio_neg_adv_mean", "E[ρ | A < 0]"),
    ("log_ratio_min", "min log ρ (τ = 1e-4: -9.2)"),
    ("veto_token_fraction", "veto token fraction"),
    ("veto_sequence_fraction", "veto sequence fraction"),
    ("clip_fraction", "clip fraction"),
    ("approx_kl", "approx KL(β ‖ π_θ)"),
    ("entropy", "entropy (nats/token)"),
)
MAIN = ("grpo-mu4", "grpo-high-staleness", "grpo-relaxed", "mu-grpo", "m2po")
SCOPES = ("grpo-relaxed", "mu-grpo-trigger", "mu-grpo-nontrigger-suffix", "mu-grpo-suffix", "mu-grpo")
LOG_TAU = math.log(1e-4)


@dataclass
class MethodRun:
    label: str
    algorithm: str = ""
    flags: tuple[str, ...] = ()
    note: str = ""
    mu: int = 0
    num_stages: int = 0
    rollout_mode: str = ""
    save: Path | None = None
    summary: dict | None = None  # bench/learning.py's summarize(); None when the run failed
    error: str = ""
    series: dict[str, list[float]] = field(default_factory=dict)

    @staticmethod
    def failed(label: str, error: str) -> MethodRun:
        return MethodRun(label=label, error=error)

    def __post_init__(self) -> None:
        if self.summary:
            updates = sorted((r for r in self.summary["rows"] if r["kind"] == "update"), key=lambda r: r["update"])
            self.series = {k: [_num(r.get(k)) for r in updates] for k, _ in PANELS}

    def late(self, key: str) -> float:
        """Median of ``key`` over the second half of the updates that have it: one minibatch holds only a few
        A < 0 responses, so a single update's E[ρ|A<0] is noisy (a median of the second half, not the last value)."""
        values = [v for v in self.series.get(key, []) if math.isfinite(v)]
        return statistics.median(values[len(values) // 2:]) if values else float("nan")

    def extreme(self, key: str, fn=min) -> float:
        values = [v for v in self.series.get(key, []) if math.isfinite(v)]
        return fn(values) if values else float("nan")

    def mean(self, key: str) -> float:
        values = [v for v in self.series.get(key, []) if math.isfinite(v)]
        return sum(values) / len(values) if values else float("nan")

    def n_eval(self) -> int:
        return next((r["n"] for r in self.summary["rows"] if r["kind"] == "eval"), 0) if self.summary else 0


def _num(v) -> float:
    return float(v) if isinstance(v, (int, float)) else float("nan")


def wall_clock(run: MethodRun) -> dict[str, float]:
    """Seconds spent syncing weights, generating and training, summed over stages; evaluation excluded.

    Generation is the rollout dataset's own measured time (its manifest's t_rollout_s): the stage record's t_rollout
    also holds the base model's evaluation, and a stage-0 dataset copied from another method took no time in this
    one although the same samples cost the generator that time."""
    stages = [r for r in run.summary["rows"] if r["kind"] == "stage"]
    gen = 0.0
    for r in stages:
        manifest = run.save / "rollouts" / f"stage_{r['stage']}" / "manifest.json"
        gen += json.loads(manifest.read_text())["t_rollout_s"]
    sync = sum(r["t_export"] for r in stages)
    train = sum(r["t_train"] for r in stages)
    return {"sync": sync, "generate": gen, "train": train, "total": sync + gen + train}


def _fmt(v: float, spec: str = ".2f") -> str:
    return "n/a" if not math.isfinite(v) else format(v, spec)


def table(runs: list[MethodRun]) -> list[str]:
    lines = ["| method | setting | μ x stages | updates | samples | E[ρ\\|A<0] 2nd-half median (min) | min log ρ | "
             "veto tokens (mean) | veto seqs (max) | clip frac (mean) | KL (max) | generate / train / total s | "
             "stage rollout reward | greedy base -> final |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        if not r.summary:
            lines.append(f"| {r.label} | FAILED: {r.error.splitlines()[0] if r.error else ''} |" + " |" * 12)
            continue
        s, w = r.summary, wall_clock(r)
        rewards = " ".join(f"{x:.2f}" for x in s["stage_rewards"])
        lines.append(
            f"| {r.label} | {r.note} | {r.mu} x {r.num_stages} ({r.rollout_mode}) | {s['updates']} | {s['samples']} | "
            f"{_fmt(r.late('ratio_neg_adv_mean'), '.3f')} ({_fmt(r.extreme('ratio_neg_adv_mean'), '.3f')}) | "
            f"{_fmt(r.extreme('log_ratio_min'), '.1f')} | {_fmt(r.mean('veto_token_fraction'), '.4f')} | "
            f"{_fmt(r.extreme('veto_sequence_fraction', max), '.3f')} | {_fmt(r.mean('clip_fraction'), '.4f')} | "
            f"{_fmt(r.extreme('approx_kl', max), '.3f')} | {w['generate']:.0f} / {w['train']:.0f} / {w['total']:.0f} | "
            f"{rewards} | {_fmt(s['before'], '.2f')} -> **{_fmt(s['after'], '.2f')}** |")
    return lines


def _acc_diff(a: MethodRun, b: MethodRun) -> tuple[float, float]:
    """Accuracy difference a - b and its binomial standard error (independent-sample bound, same n problems)."""
    pa, pb, n = a.summary["after"], b.summary["after"], max(a.n_eval(), 1)
    return pa - pb, math.sqrt((pa * (1 - pa) + pb * (1 - pb)) / n)


def verdicts(runs: list[MethodRun]) -> list[str]:
    by = {r.label: r for r in runs if r.summary}
    out = ["Rules (fixed before the full run): *drift* = median E[ρ|A<0] over the second half of the updates <= 0.8 "
           "(>= 0.9: no drift; between: inconclusive); *near 1* = that median in [0.9, 1.1]; accuracy differences "
           "count when they exceed 2 binomial standard errors of the difference (one seed, n held-out problems).", ""]

    def have(*labels: str) -> bool:
        return all(lbl in by for lbl in labels)

    if have("grpo-relaxed"):
        rel = by["grpo-relaxed"]
        v = rel.late("ratio_neg_adv_mean")
        verdict = "reproduced" if v <= 0.8 else "not reproduced" if v >= 0.9 else "inconclusive"
        out.append(f"1. **E[ρ|A<0] collapses without the veto** (grpo-relaxed, clip [0, 5]): **{verdict}**. "
                   f"Second-half median E[ρ|A<0] {v:.3f} (min {rel.extreme('ratio_neg_adv_mean'):.3f}), min log ρ "
                   f"{rel.extreme('log_ratio_min'):.1f}, final greedy {rel.summary['after']:.2f} "
                   f"(base {rel.summary['before']:.2f}).")
        if have("mu-grpo-trigger"):
            t = by["mu-grpo-trigger"]
            out.append(f"   Trigger-token veto only (paper: still collapses): second-half median E[ρ|A<0] "
                       f"{t.late('ratio_neg_adv_mean'):.3f}, final greedy {t.summary['after']:.2f}.")
    if have("grpo-relaxed", "mu-grpo"):
        drift = by["grpo-relaxed"].late("ratio_neg_adv_mean") <= 0.8
        parts = []
        ok = True
        for lbl in ("mu-grpo", "mu-grpo-suffix", "mu-grpo-nontrigger-suffix"):
            if lbl in by:
                v = by[lbl].late("ratio_neg_adv_mean")
                ok &= 0.9 <= v <= 1.1
                parts.append(f"{lbl} {v:.3f} (veto tokens {by[lbl].mean('veto_token_fraction'):.4f})")
        verdict = ("reproduced" if ok else "not reproduced") if drift else \
            "inconclusive (no drift to cure: grpo-relaxed did not drift)"
        out.append(f"2. **The veto keeps E[ρ|A<0] near 1**: **{verdict}**. Second-half median E[ρ|A<0]: "
                   f"{'; '.join(parts)}.")
    if have("mu-grpo", "grpo-high-staleness"):
        d, se = _acc_diff(by["mu-grpo"], by["grpo-high-staleness"])
        verdict = "reproduced" if d > 2 * se else "not reproduced" if d < -2 * se else "inconclusive"
        out.append(f"3. **μ-GRPO >= high-staleness GRPO** (final greedy accuracy): **{verdict}**. "
                   f"{by['mu-grpo'].summary['after']:.2f} vs {by['grpo-high-staleness'].summary['after']:.2f} "
                   f"(difference {d:+.2f}, 2 SE = {2 * se:.2f}).")
    if have("mu-grpo", "grpo-mu4"):
        d, se = _acc_diff(by["mu-grpo"], by["grpo-mu4"])
        wm, wg = wall_clock(by["mu-grpo"])["total"], wall_clock(by["grpo-mu4"])["total"]
        close = d >= -2 * se
        verdict = "reproduced" if close and wm < wg else "not reproduced"
        if close and wm < wg and d <= 2 * se and abs(wm / wg - 1) < 0.1:
            verdict = "inconclusive (accuracy within noise; wall-clock within 10%)"
        out.append(f"4. **μ-GRPO close to standard GRPO at less wall-clock**: **{verdict}**. Greedy "
                   f"{by['mu-grpo'].summary['after']:.2f} vs {by['grpo-mu4'].summary['after']:.2f} (difference "
                   f"{d:+.2f}, 2 SE = {2 * se:.2f}); sync + generation + training {wm:.0f} s vs {wg:.0f} s "
                   f"({wm / wg:.2f}x).")
    return out


def _log_ratio_axis(ax) -> None:
    """Log scale with plain labels at 1, 2, 3, 5, 7 x 10^k (ratios from ~0.1 to ~10)."""
    from matplotlib.ticker import FormatStrFormatter, LogLocator, NullFormatter

    ax.set_yscale("log")
    ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 3.0, 5.0, 7.0)))
    ax.yaxis.set_major_formatter(FormatStrFormatter("%g"))
    ax.yaxis.set_minor_formatter(NullFormatter())


def figure(runs: list[MethodRun], labels: tuple[str, ...], path: Path, title: str) -> bool:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    chosen = [r for lbl in labels for r in runs if r.label == lbl and r.summary]
    if not chosen:
        return False
    fig, axes = plt.subplots(2, 4, figsize=(13, 5.6))
    for ax, (key, name) in zip(axes.flat, PANELS):
        for r in chosen:
            ys = r.series[key]
            ax.plot(range(1, len(ys) + 1), ys, marker=".", markersize=4, linewidth=1.2, label=r.label)
        if key == "ratio_neg_adv_mean":
            ax.axhline(1.0, color="grey", linewidth=0.6)
            _log_ratio_axis(ax)  # a drift to 0.2 and a spike to 6 on one panel
        if key == "log_ratio_min":
            ax.axhline(LOG_TAU, color="grey", linewidth=0.6, linestyle="--")
        ax.set_title(name, fontsize=9)
        ax.tick_params(labelsize=7)
        ax.set_xlabel("update", fontsize=7)
    axes.flat[0].legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=72)
    plt.close(fig)
    return True


def accuracy_figure(runs: list[MethodRun], path: Path) -> bool:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = [r for r in runs if r.summary]
    if not done:
        return False
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 3.8))
    names = [r.label for r in done]
    a1.barh(names, [r.summary["after"] for r in done], color="tab:blue", label="final")
    a1.axvline(done[0].summary["before"], color="grey", linestyle="--", label="base")
    a1.set_xlabel(f"held-out greedy accuracy ({done[0].n_eval()} problems)", fontsize=8)
    a1.legend(fontsize=7)
    walls = [wall_clock(r) for r in done]
    a2.barh(names, [w["generate"] for w in walls], label="generate")
    a2.barh(names, [w["train"] for w in walls], left=[w["generate"] for w in walls], label="train")
    a2.barh(names, [w["sync"] for w in walls], left=[w["generate"] + w["train"] for w in walls], label="sync")
    a2.set_xlabel("wall-clock, s (evaluation excluded)", fontsize=8)
    a2.legend(fontsize=7)
    for ax in (a1, a2):
        ax.tick_params(labelsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=72)
    plt.close(fig)
    return True


def sweep_runs(sweep_dir: Path) -> list[tuple[float, MethodRun]]:
    """The finished runs of a ``bench/fidelity.py --sweep`` folder, by learning rate."""
    found = []
    for d in sorted(sweep_dir.glob("grpo-relaxed-lr*")):
        rows = read_metrics(d)
        if d.is_dir() and any(r["kind"] == "run" for r in rows):
            summary = {"rows": rows, "stage_rewards": [r["reward_mean"] for r in rows if r["kind"] == "stage"]}
            found.append((float(d.name.removeprefix("grpo-relaxed-lr")),
                          MethodRun(label=d.name, algorithm="grpo-relaxed", save=d, summary=summary)))
    return sorted(found, key=lambda x: x[0])


def sweep_section(sweep_dir: Path, fig_dir: Path, lr: float, mu: int) -> list[str]:
    found = sweep_runs(sweep_dir)
    if not found:
        return [f"(no finished sweep runs in {sweep_dir})"]
    drifting = [x for x, r in found if r.late("ratio_neg_adv_mean") <= 0.8]
    rule = (f"Choice rule: the smallest swept lr whose second-half median E[ρ|A<0] is <= 0.8 (the drift rule of "
            f"the verdicts below); if none drifts, 1e-4, where lr x μ = {1e-4 * mu:.1e} matches "
            f"the paper's 1e-6 x 1024 = 1.0e-3 (Adam moves each weight by about lr per update, so lr x μ stands in "
            f"for how far π_θ can move from β within a stage). Here: "
            + (f"{min(drifting):g} drifts" if drifting else "no swept lr drifts by that rule, so 1e-4")
            + f"; the full run used lr {lr:g}.")
    lines = ["| lr | updates | E[ρ\\|A<0] first / 2nd-half median / min | min log ρ | updates with min log ρ < log τ | "
             "KL (max) | rollout reward |", "|---|---|---|---|---|---|---|"]
    for lr, r in found:
        ratio = [v for v in r.series["ratio_neg_adv_mean"] if math.isfinite(v)]
        below = sum(v < LOG_TAU for v in r.series["log_ratio_min"] if math.isfinite(v))
        first = ratio[0] if ratio else math.nan
        lines.append(f"| {lr:g} | {len(r.series['reward_mean'])} | {_fmt(first, '.3f')} / "
                     f"{_fmt(r.late('ratio_neg_adv_mean'), '.3f')} / {_fmt(r.extreme('ratio_neg_adv_mean'), '.3f')} | "
                     f"{_fmt(r.extreme('log_ratio_min'), '.1f')} | {below} | "
                     f"{_fmt(r.extreme('approx_kl', max), '.3f')} | "
                     f"{' '.join(f'{x:.2f}' for x in r.summary['stage_rewards'])} |")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(12, 3.4))
    for lr, r in found:
        for ax, key in zip(axes, ("ratio_neg_adv_mean", "log_ratio_min", "approx_kl")):
            ys = r.series[key]
            ax.plot(range(1, len(ys) + 1), ys, marker=".", label=f"lr {lr:g}")
    _log_ratio_axis(axes[0])
    for ax, (_, name) in zip(axes, [p for p in PANELS if p[0] in ("ratio_neg_adv_mean", "log_ratio_min",
                                                                    "approx_kl")]):
        ax.set_title(f"grpo-relaxed: {name}", fontsize=9)
        ax.set_xlabel("update", fontsize=7)
        ax.tick_params(labelsize=7)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(fig_dir / "sweep.png", dpi=72)
    plt.close(fig)
    return lines + ["", rule, "", f"![lr sweep]({fig_dir.name}/sweep.png)"]


def write_report(a, runs: list[MethodRun]) -> None:
    """The markdown report at ``a.report`` and its figures in the folder beside it (``<report stem>/``)."""
    fig_dir = a.report.parent / a.report.stem
    fig_dir.mkdir(parents=True, exist_ok=True)
    done = [r for r in runs if r.summary]
    ref = done[0].summary if done else None
    measured = {r.label: r.summary["before"] for r in done
                if any(x["kind"] == "eval" and x["label"] == "base" for x in r.summary["rows"])}
    for r in done:  # a run on a copied stage-0 dataset skips the base evaluation: same model, same problems
        if not math.isfinite(r.summary["before"]) and measured:
            r.summary["before"] = next(iter(measured.values()))
    lines = [
        "# Fidelity: the paper's mechanism in megamu, measured on CPU (issue 15)", "",
        f"Generated by `{a.command}` on {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} "
        f"({platform.machine()}, {os.cpu_count()} cores; OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')})."
        " Every number below is read from the runs' metrics.jsonl and rollout manifests.", "",
        f"Settings: high-staleness methods μ = {a.mu} x {a.num_stages} stage(s), standard GRPO μ = {a.low_mu} "
        f"(colocated); {a.prompts_per_update} prompts x {a.n_samples_per_prompt} samples per update; lr {a.lr:g}; "
        f"seed {a.seed}; so every method makes {a.mu * a.num_stages} updates on "
        f"{a.mu * a.num_stages * a.prompts_per_update * a.n_samples_per_prompt} rollout samples. Held-out greedy "
        f"accuracy on the same {done[0].n_eval() if done else '?'} problems for every method."
        + (f" Extra trainer flags: `{' '.join(getattr(a, 'extra', []))}`." if getattr(a, "extra", None) else ""),
        "", "## Results", "", *table(runs), "",
        "E[ρ|A<0], min log ρ, veto, clip and KL statistics are per update over the samples it trains on (A != 0; "
        "groups with equal rewards carry no gradient and are skipped); *2nd-half median*: median over the second half "
        "of the updates that have A < 0 tokens. Wall-clock: weight sync + generation + training, evaluation excluded "
        "(`fidelity_report.wall_clock`). Base greedy accuracy measured by "
        + ", ".join(f"{k} ({v:.2f})" for k, v in measured.items())
        + " (the runs that generated their own stage 0; the others reuse that number).", "",
    ]
    if figure(runs, MAIN, fig_dir / "per_update_methods.png", "methods at the same rollout budget (cf. paper Fig. 2)"):
        lines += [f"![per-update metrics, methods]({fig_dir.name}/per_update_methods.png)", ""]
    if figure(runs, SCOPES, fig_dir / "per_update_scopes.png", "veto scopes under clip [0, 5] (cf. paper Fig. 3)"):
        lines += [f"![per-update metrics, veto scopes]({fig_dir.name}/per_update_scopes.png)", ""]
    if accuracy_figure(runs, fig_dir / "accuracy_wallclock.png"):
        lines += [f"![accuracy and wall-clock]({fig_dir.name}/accuracy_wallclock.png)", ""]
    lines += ["## The paper's claims at this scale", "", *verdicts(runs), "",
              "Limits of this measurement: one seed; 100 held-out problems (binomial standard error about 0.05 per "
              "accuracy); a 135M model on two-digit addition, whose responses are short and mostly formatting tokens "
              "that stay near ρ = 1, which dilutes E[ρ|A<0]; the paper's staleness (μ = 1024 at lr 1e-6) is stood in "
              "for by a high learning rate at μ = 12 (see the sweep), so the drift here is fast and large rather than "
              "slow; wall-clock is measured on a shared CPU machine whose load varied during the run, with the local "
              "engine (no separate inference server, so the paper's weight-sync and memory-contention savings barely "
              "exist here).", ""]
    if a.sweep_dir is not None:
        lines += ["## Learning-rate sweep (why this lr)", "",
                  f"`bench/fidelity.py --sweep` output in `{a.sweep_dir}`: grpo-relaxed, the same μ, prompts per "
                  "update and samples per prompt, evaluation off (so its prompts are drawn from a smaller data set "
                  "than the runs above), one shared stage-0 dataset.", "",
                  *sweep_section(a.sweep_dir, fig_dir, a.lr, a.mu), ""]
    if getattr(a, "notes", None) is not None:
        lines += [f"## Reading (hand-written: `{a.notes}`)", "", a.notes.read_text().strip(), ""]
    if ref is None:
        lines += ["No method finished."]
    a.report.write_text("\n".join(lines) + "\n")
