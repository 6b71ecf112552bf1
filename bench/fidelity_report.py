"""bench/fidelity.py's report: the runs' table, figures in the paper's shape and the per-claim verdicts.

Every number comes from a run's own files: metrics.jsonl (the trainer's per-update and per-stage records) and
lab_eval.json (the bench's greedy held-out accuracy of the run's exports). The rules below were fixed before the
runs they judge; the report prints them next to the verdicts.
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from megamu.metrics import read_metrics

# per-update metrics plotted (the trainer's update records: megamu.training.step / megamu.algo.loss)
PANELS = (
    ("ratio_neg_adv_mean", "E[ρ | A < 0]"),
    ("log_ratio_min", "min log ρ (τ = 1e-4: -9.2)"),
    ("veto_token_fraction", "veto token fraction"),
    ("veto_sequence_fraction", "veto sequence fraction"),
    ("clip_fraction", "clip fraction"),
    ("approx_kl", "approx KL(β ‖ π_θ)"),
    ("entropy", "entropy (nats/token)"),
    ("response_length_mean", "response length (tokens)"),
)
STAGED_MAIN = ("grpo-high-staleness", "grpo-relaxed", "mu-grpo", "m2po")
SCOPES = ("grpo-relaxed", "mu-grpo-trigger", "mu-grpo-nontrigger-suffix", "mu-grpo-suffix", "mu-grpo")
CURVE = ("grpo-high-staleness", "grpo-relaxed", "mu-grpo")

# --- the rules, fixed before the runs ---------------------------------------------------------------------------
RULES = """\
- *SE(p)*: the binomial standard error sqrt(p (1 - p) / n) of a greedy accuracy on the n held-out problems
  (p held inside [1/n, 1 - 1/n]).
- **learned**: the best held-out accuracy of the run's evaluations (update 0 excluded) >= base + 2 SE(base).
- **collapsed**: the final held-out accuracy < base - 3 SE(base), or < half the run's best accuracy.
- **lr rule**: the largest swept lr at which `grpo` at μ = 4 learned and did not collapse.
- *stage-end E[ρ|A<0]*: the lowest, over the run's rollout stages, of the median per-update E[ρ|A<0] over the last
  quarter of that stage's updates (one minibatch holds few A < 0 tokens, so a single update's value is noisy; β is
  reset at each stage, so the drift shows at the end of the stage where it happens). It *falls* when <= 0.8 and is
  *near 1* in (0.8, 1.25). (Changed before the headline runs, after two probe runs at lr 1e-4, μ = 64, 256 updates,
  which are not in this report: the first rule, the median over the run's last quarter, read a run that had
  collapsed in its first stage at 0.98, because later stages of a collapsed run have few mixed-reward groups.)
- (a) holds when `grpo-relaxed` collapsed; (b) when `mu-grpo-trigger` collapsed; (c) when none of
  `mu-grpo-nontrigger-suffix`, `mu-grpo-suffix`, `mu-grpo` collapsed (all at the headline μ); (d) when every
  collapsed staged run's stage-end E[ρ|A<0] falls and every stable staged run with clip [0, 5] has it near 1; (e) when
  `mu-grpo` at the headline μ has a final accuracy >= `grpo` at μ = 4's minus 2 SE of the difference; (f) when
  `grpo-high-staleness`'s final accuracy is below both `grpo`'s and `mu-grpo`'s by more than 2 SE of the difference.
  With several seeds, a method collapsed when most of its seeds did; accuracies are seed means and the SE of a mean
  is the larger of the binomial one and the seeds' spread.
- A claim whose runs are missing is *not run*."""
LATE_FALLS, LATE_NEAR = 0.8, (0.8, 1.25)


def se(p: float, n: int) -> float:
    p = min(max(p, 1 / n), 1 - 1 / n)
    return math.sqrt(p * (1 - p) / n)


@dataclass
class RunResult:
    save: Path
    method: str
    mu: int
    seed: int
    lr: float
    updates: int
    samples: int
    evals: list[dict]  # {"update", "accuracy", "n", "mean_length", "truncated"}; update 0 is the base model
    note: str = ""
    train_s: float = math.nan
    series: dict[str, list[float]] = field(default_factory=dict)
    stage_truncation: list[float] = field(default_factory=list)
    stage_of_update: list[int] = field(default_factory=list)

    @staticmethod
    def load(save: Path, note: str) -> RunResult:
        rec = json.loads((save / "lab_eval.json").read_text())
        rows = read_metrics(save)
        ups = sorted((r for r in rows if r["kind"] == "update"), key=lambda r: r["update"])
        stages = [r for r in rows if r["kind"] == "stage"]
        samples = rec["updates"] * rec["prompts_per_update"] * rec["n_samples_per_prompt"]
        return RunResult(save=save, method=rec["method"], mu=rec["mu"], seed=rec["seed"], lr=rec["lr"],
                         updates=len(ups), samples=samples, evals=rec["evals"], note=note, train_s=rec["train_s"],
                         series={k: [_num(r.get(k)) for r in ups] for k, _ in PANELS},
                         stage_truncation=[_num(s.get("truncation_rate")) for s in stages],
                         stage_of_update=[r["stage"] for r in ups])

    @property
    def n(self) -> int:
        return self.evals[0]["n"]

    @property
    def base(self) -> float:
        return self.evals[0]["accuracy"]

    @property
    def final(self) -> float:
        return self.evals[-1]["accuracy"]

    @property
    def best(self) -> float:
        return max(e["accuracy"] for e in self.evals[1:]) if len(self.evals) > 1 else math.nan

    @property
    def learned(self) -> bool:
        return self.best >= self.base + 2 * se(self.base, self.n)

    @property
    def collapsed(self) -> bool:
        return self.final < self.base - 3 * se(self.base, self.n) or self.final < self.best / 2

    def late(self, key: str) -> float:
        values = [v for v in self.series.get(key, []) if math.isfinite(v)]
        return statistics.median(values[-max(len(values) // 4, 1):]) if values else math.nan

    def stage_end(self, key: str = "ratio_neg_adv_mean") -> float:
        """The lowest over stages of the median of ``key`` over each stage's last quarter of updates."""
        by: dict[int, list[float]] = {}
        for st, v in zip(self.stage_of_update, self.series.get(key, [])):
            by.setdefault(st, []).append(v)
        ends = []
        for values in by.values():
            tail = [v for v in values[-max(len(values) // 4, 1):] if math.isfinite(v)]
            if tail:
                ends.append(statistics.median(tail))
        return min(ends) if ends else math.nan

    def extreme(self, key: str, fn=min) -> float:
        values = [v for v in self.series.get(key, []) if math.isfinite(v)]
        return fn(values) if values else math.nan


def _num(v) -> float:
    return float(v) if isinstance(v, (int, float)) else math.nan


def summary_rows(runs: list[RunResult]) -> list[dict]:
    return [{"method": r.method, "mu": r.mu, "seed": r.seed, "lr": r.lr, "updates": r.updates, "samples": r.samples,
             "base_accuracy": r.base, "final_accuracy": r.final, "best_accuracy": r.best, "held_out": r.n,
             "learned": r.learned, "collapsed": r.collapsed,
             "stage_end_ratio_neg_adv": _finite(r.stage_end()),
             "final_truncated": r.evals[-1]["truncated"], "train_s": r.train_s} for r in runs]


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None


def sweep_choice(runs: list[RunResult]) -> float | None:
    """The lr rule: the largest lr at which grpo (μ = 4 in the sweep) learned without collapse."""
    ok = [r.lr for r in runs if r.method == "grpo" and r.learned and not r.collapsed]
    return max(ok) if ok else None


@dataclass
class Group:
    """One method at one μ over its seeds."""

    runs: list[RunResult]

    @property
    def final(self) -> float:
        return statistics.mean(r.final for r in self.runs)

    @property
    def best(self) -> float:
        return statistics.mean(r.best for r in self.runs)

    @property
    def se(self) -> float:
        binomial = se(self.final, self.runs[0].n)
        if len(self.runs) < 2:
            return binomial
        return max(binomial / math.sqrt(len(self.runs)),
                   statistics.stdev(r.final for r in self.runs) / math.sqrt(len(self.runs)))

    @property
    def collapsed(self) -> bool:
        return 2 * sum(r.collapsed for r in self.runs) > len(self.runs)


def groups(runs: list[RunResult], lr: float) -> dict[tuple[str, int], Group]:
    out: dict[tuple[str, int], Group] = {}
    for r in runs:
        if r.lr == lr:
            out.setdefault((r.method, r.mu), Group([])).runs.append(r)
    return out


def verdicts(runs: list[RunResult], lr: float, mu: int, low_mu: int) -> list[str]:
    g = groups(runs, lr)

    def get(method: str, m: int = mu) -> Group | None:
        return g.get((method, m))

    def say(claim: str, needed: list[Group | None], holds, detail) -> str:
        if any(x is None for x in needed):
            return f"{claim} **not run**."
        return f"{claim} **{'holds' if holds() else 'does not hold'}**: {detail()}."

    def acc(x: Group) -> str:
        return f"final {x.final:.3f} (best {x.best:.3f}){' collapsed' if x.collapsed else ''}"

    out = []
    rel, trig, mug, grpo, hs = get("grpo-relaxed"), get("mu-grpo-trigger"), get("mu-grpo"), get("grpo", low_mu), \
        get("grpo-high-staleness")
    stable = [get(m) for m in ("mu-grpo-nontrigger-suffix", "mu-grpo-suffix", "mu-grpo")]
    out.append(say("(a) Relaxed clipping [0, 5] without the veto collapses:", [rel], lambda: rel.collapsed,
                   lambda: f"grpo-relaxed {acc(rel)}, base {rel.runs[0].base:.3f}"))
    out.append(say("(b) The trigger-only veto (T) still collapses:", [trig], lambda: trig.collapsed,
                   lambda: f"mu-grpo-trigger {acc(trig)}"))
    out.append(say("(c) The suffix scopes H_κ, S_κ and S_seq stay stable:", stable,
                   lambda: not any(x.collapsed for x in stable),
                   lambda: "; ".join(f"{x.runs[0].method} {acc(x)}" for x in stable)))
    staged = [r for r in runs if r.lr == lr and r.mu == mu]
    relaxed = {"grpo-relaxed", "mu-grpo", "mu-grpo-trigger", "mu-grpo-nontrigger-suffix", "mu-grpo-suffix", "m2po"}
    falls = [r for r in staged if r.collapsed]
    near = [r for r in staged if not r.collapsed and r.method in relaxed]

    def d_holds() -> bool:
        return all(r.stage_end() <= LATE_FALLS for r in falls) and \
            all(LATE_NEAR[0] < r.stage_end() < LATE_NEAR[1] for r in near)

    out.append(say("(d) E[ρ|A<0] falls in collapsed runs and stays near 1 in stable ones:",
                   [None] if not staged else [], d_holds,
                   lambda: "collapsed: " + (", ".join(f"{r.method} s{r.seed} {r.stage_end():.3f}"
                                                     for r in falls) or "none")
                   + "; stable, clip [0, 5]: " + (", ".join(f"{r.method} s{r.seed} {r.stage_end():.3f}"
                                                           for r in near) or "none")))

    def diff(x: Group, y: Group) -> tuple[float, float]:
        return x.final - y.final, math.hypot(x.se, y.se)

    out.append(say(f"(e) μ-GRPO at μ = {mu} reaches standard GRPO's accuracy (μ = {low_mu}) within 2 SE:",
                   [mug, grpo], lambda: diff(mug, grpo)[0] >= -2 * diff(mug, grpo)[1],
                   lambda: f"mu-grpo {acc(mug)} vs grpo {acc(grpo)}: difference {diff(mug, grpo)[0]:+.3f}, "
                           f"2 SE = {2 * diff(mug, grpo)[1]:.3f}"))
    out.append(say("(f) Clipped high-staleness GRPO plateaus lower:", [hs, grpo, mug],
                   lambda: all(diff(hs, y)[0] < -2 * diff(hs, y)[1] for y in (grpo, mug)),
                   lambda: f"grpo-high-staleness {acc(hs)}; minus grpo {diff(hs, grpo)[0]:+.3f} "
                           f"(2 SE {2 * diff(hs, grpo)[1]:.3f}), minus mu-grpo {diff(hs, mug)[0]:+.3f} "
                           f"(2 SE {2 * diff(hs, mug)[1]:.3f})"))
    return out


def _fmt(x: float, spec: str) -> str:
    return format(x, spec) if math.isfinite(x) else "–"


def table(runs: list[RunResult]) -> list[str]:
    lines = ["| method | μ | seed | lr | updates | samples | held-out acc base / best / **final** | learned | "
             "collapsed | stage-end E[ρ\\|A<0] | min log ρ | clip frac (mean) | veto tok / seq (mean) | KL (max) | "
             "entropy (late) | length (late) | rollout truncated (max stage) | held-out truncated (final) | "
             "trainer s |",
             "|" + "---|" * 19]
    for r in sorted(runs, key=lambda r: (r.lr, r.method, r.mu, r.seed)):
        mean = {k: statistics.mean([v for v in r.series[k] if math.isfinite(v)] or [math.nan]) for k, _ in PANELS}
        lines.append(
            f"| {r.method} | {r.mu} | {r.seed} | {r.lr:g} | {r.updates} | {r.samples} | {r.base:.3f} / "
            f"{_fmt(r.best, '.3f')} / **{r.final:.3f}** | {'yes' if r.learned else 'no'} | "
            f"{'**yes**' if r.collapsed else 'no'} | {_fmt(r.stage_end(), '.3f')} | "
            f"{_fmt(r.extreme('log_ratio_min'), '.1f')} | {_fmt(mean['clip_fraction'], '.4f')} | "
            f"{_fmt(mean['veto_token_fraction'], '.4f')} / {_fmt(mean['veto_sequence_fraction'], '.3f')} | "
            f"{_fmt(r.extreme('approx_kl', max), '.3f')} | {_fmt(r.late('entropy'), '.3f')} | "
            f"{_fmt(r.late('response_length_mean'), '.1f')} | {_fmt(max(r.stage_truncation, default=math.nan), '.3f')}"
            f" | {r.evals[-1]['truncated']:.3f} | "
            f"{r.train_s:.0f} |")
    return lines


def write_report(a, runs: list[RunResult]) -> None:
    """The markdown report at ``a.report``, its figures in the folder beside it (``<report stem>/``)."""
    import os
    import platform
    import time

    import fidelity_figures as figs

    fig_dir = a.report.parent / a.report.stem
    fig_dir.mkdir(parents=True, exist_ok=True)
    mu, low = max(a.mu), a.low_mu
    main = [r for r in runs if r.lr == a.lr]
    head = [r for r in main if r.mu == mu or (r.mu == low and r.method in ("grpo", "mu-grpo-mu4"))]
    build = json.loads((Path(a.model) / "lab_build.json").read_text())
    spec = build["spec"]
    out = [
        "# Fidelity: the paper's Figures 2-3 at the paper's staleness, on a lab model (issue 23)", "",
        f"Generated by `{a.command}` on {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} ({platform.machine()}, "
        f"{os.cpu_count()} cores, one thread per run, at most one run per core). Every number is read from the runs' "
        "metrics.jsonl and the bench's held-out evaluations of their exports (`lab_eval.json`).", "",
        "## Set-up", "",
        f"- **Lab model** (`megamu/lab/model.py`): Llama-shaped, {spec['num_hidden_layers']} layers, width "
        f"{spec['hidden_size']}, {spec['num_attention_heads']} heads / {spec['num_key_value_heads']} KV heads, MLP "
        f"{spec['intermediate_size']}, the char tokenizer of megamu/tiny.py; fine-tuned from random weights for "
        f"{build['steps']} steps ({build['seconds']:.0f} s on one thread) until its sampled (T = 1) accuracy on "
        f"{spec['probe_problems']} probe problems reached {build['sampled_accuracy']:.2f} (greedy "
        f"{build['greedy_accuracy']:.2f}).",
        f"- **Task** (`megamu/lab/task.py`): {spec['digits']}-digit additions, answered column by column with carries "
        "(one line per column), then `\\boxed{sum}`: about 46 response tokens. The trainer's math reward (last "
        "`\\boxed{}`) scores rollouts; held-out accuracy is greedy exact match of the boxed sum on "
        f"{runs[0].n if runs else '?'} problems drawn apart from the {a.train_problems} training problems.",
        f"- **Schedule**: every run makes {a.updates} updates of {a.prompts_per_update} prompts x "
        f"{a.n_samples_per_prompt} samples ({a.updates * a.prompts_per_update * a.n_samples_per_prompt} rollout "
        f"samples), lr {a.lr:g} (the sweep's rule below), replies up to {a.max_response_len} tokens. Staged methods: "
        f"μ = {mu}, {a.updates // mu} stages. `grpo` and `mu-grpo-mu4`: μ = {low}, colocated, {a.updates // low} "
        f"refreshes. Held-out evaluation every {a.eval_every} updates. Seeds: "
        f"{sorted({r.seed for r in main}) or '–'}."
        + (f" Extra trainer flags: `{' '.join(a.extra)}`." if a.extra else ""),
        "", "## Results at the chosen lr", "", *table(main), "",
        "Per-update statistics are the trainer's, over the samples each update trains on (groups with equal rewards "
        "carry no gradient and are skipped). *late*: median over the last quarter of the updates. *held-out "
        "truncated*: greedy held-out replies that hit the length limit without EOS at the last evaluation.", "",
    ]
    by = {r.method: r for r in sorted(head, key=lambda r: -r.seed)}  # seed 1 last, so it is the one drawn
    pick = [by[m] for m in ("grpo-high-staleness", "grpo-relaxed") if m in by]
    if figs.fig2(pick, fig_dir / "fig2_clip.png"):
        out += [f"![Fig. 2 shape]({fig_dir.name}/fig2_clip.png)", ""]
    if figs.fig3([by[m] for m in SCOPES if m in by], fig_dir / "fig3_scopes.png"):
        out += [f"![Fig. 3 shape]({fig_dir.name}/fig3_scopes.png)", ""]
    if figs.per_update([by[m] for m in ("grpo", *STAGED_MAIN) if m in by], PANELS, fig_dir / "per_update.png",
                       "per-update statistics, methods at the same samples"):
        out += [f"![per-update statistics]({fig_dir.name}/per_update.png)", ""]
    out += ["## The paper's claims at this scale", "", "Rules (fixed before the runs):", "", RULES, "",
            *[f"- {v}" for v in verdicts(main, a.lr, mu, low)], ""]
    out += ["## Staleness curve", "", *staleness_section(main, a.lr, low, fig_dir, "staleness.png")]
    grpo_runs = [r for r in runs if r.method == "grpo" and r.mu == low]
    swept = [r for r in grpo_runs if r.seed == min(x.seed for x in grpo_runs)]  # the sweep ran on one seed
    out += ["## Learning-rate sweep (the rule that chose the lr)", ""]
    if swept:
        out += ["| lr | base | best | final | learned | collapsed | KL (max) | held-out truncated (final) |",
                "|---|---|---|---|---|---|---|---|"]
        out += [f"| {r.lr:g} | {r.base:.3f} | {r.best:.3f} | {r.final:.3f} | {'yes' if r.learned else 'no'} | "
                f"{'yes' if r.collapsed else 'no'} | {_fmt(r.extreme('approx_kl', max), '.3f')} | "
                f"{r.evals[-1]['truncated']:.3f} |" for r in sorted(swept, key=lambda r: r.lr)]
        choice = sweep_choice(swept)
        out += ["", f"The rule picks lr = {choice:g}." if choice else "No swept lr passes the rule.", ""]
        if figs.sweep(swept, fig_dir / "sweep.png"):
            out += [f"![lr sweep]({fig_dir.name}/sweep.png)", ""]
    else:
        out += ["No sweep runs in this folder.", ""]
    out += other_lrs(a, runs, fig_dir, mu, low)
    if getattr(a, "notes", None) is not None:
        out += [f"## Reading (hand-written: `{a.notes}`)", "", a.notes.read_text().strip(), ""]
    out += ["## History", "", "The previous report (`docs/fidelity-135m.md`, SmolLM2-135M, 12 updates per method at "
            "lr 1e-4 standing in for staleness) is kept as history only. It was superseded because every method "
            "collapsed there, standard GRPO at μ = 4 included: the step size did the damage, not staleness, so it "
            "could not show the paper's mechanism. Here the staleness is real (μ updates on one static dataset) and "
            "the lr is the largest at which standard GRPO is stable.", ""]
    a.report.write_text("\n".join(out) + "\n")


def staleness_section(runs: list[RunResult], lr: float, low: int, fig_dir: Path, name: str) -> list[str]:
    """The title question at one lr: final and best accuracy of CURVE's methods against μ, a table and a figure."""
    import fidelity_figures as figs

    g = groups(runs, lr)
    if not figs.staleness_curve(g, CURVE, low, fig_dir / name):
        return [f"Not run at lr {lr:g} (it needs the three methods at two or more μ; "
                "`bench/fidelity.py --mu 4 64 ... --methods grpo-high-staleness grpo-relaxed mu-grpo`); a curve run at "
                "another lr is in that lr's section below.", ""]
    rows = sorted((k, v) for k, v in g.items() if k[0] in CURVE or k == ("grpo", low))
    out = ["| method | μ | stages | seeds | final | best | collapsed |", "|---|---|---|---|---|---|---|"]
    out += [f"| {m} | {u} | {x.runs[0].updates // u} | {len(x.runs)} | {x.final:.3f} | {x.best:.3f} | "
            f"{'yes' if x.collapsed else 'no'} |" for (m, u), x in rows]
    return out + ["", f"![staleness curve at lr {lr:g}]({fig_dir.name}/{name})", ""]


def other_lrs(a, runs: list[RunResult], fig_dir: Path, mu: int, low: int) -> list[str]:
    """Runs of methods other than the sweep's at learning rates the rule did not choose: shown, never used above."""
    import fidelity_figures as figs

    lrs = sorted({r.lr for r in runs if r.lr != a.lr and r.method != "grpo"})
    if not lrs:
        return []
    out = ["## Other learning rates (outside the rule; no verdict above uses them)", ""]
    for lr in lrs:
        at = [r for r in runs if r.lr == lr and (r.method != "grpo" or r.mu == low)]
        # the claims at the largest μ this lr's μ-GRPO ran at (its own sittings may have gone further than --mu)
        top = max((r.mu for r in at if r.method == "mu-grpo"), default=mu)
        out += [f"### lr {lr:g}", "", *table(at), "",
                f"The same rules applied at this lr and μ = {top}, for reading only:", "",
                *[f"- {v}" for v in verdicts(at, lr, top, low)], ""]
        by = {r.method: r for r in sorted(at, key=lambda r: -r.seed) if r.mu in (top, low)}
        name = f"scopes_lr{lr:g}.png"
        if figs.fig3([by[m] for m in ("grpo", "grpo-high-staleness", *SCOPES) if m in by], fig_dir / name,
                     f"lr {lr:g}: accuracy and E[ρ|A<0]"):
            out += [f"![accuracy and E[ρ|A<0] at lr {lr:g}]({fig_dir.name}/{name})", ""]
        if len({r.mu for r in at if r.method in CURVE}) > 1:
            out += [f"Staleness curve at lr {lr:g}:", "",
                    *staleness_section(at, lr, low, fig_dir, f"staleness_lr{lr:g}.png")]
    return out
