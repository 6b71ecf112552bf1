"""bench/fidelity.py's report (docs/fidelity-4stage.md): the rules, the gate, the lr rule, the runs' tables, figures
in the paper's shape and the per-claim verdicts, all read from the committed run summaries (bench/lab/summary.py)
so that ``--report-only`` regenerates it in any later sitting. Runs not finished yet are listed as pending.
"""

from __future__ import annotations

import copy
import functools
import math
import os
import platform
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

from bench.lab import plan
from bench.lab import round2 as r2
from bench.lab import round3 as r3
from bench.lab.plan import collapsed, holds_peak, learned, se

LATE_FALLS, LATE_NEAR = 0.8, (0.8, 1.25)
CLIP_RELAXED = {"grpo-relaxed", "mu-grpo", "mu-grpo-trigger", "mu-grpo-nontrigger-suffix", "mu-grpo-suffix",
                "mu-grpo-tau1e-2", "mu-grpo-tau1e-6", "m2po"}


@dataclass
class Group:
    """One method at one μ over its seeds."""

    runs: list

    def mean(self, what: str) -> float:
        return statistics.mean(getattr(r, what) for r in self.runs)

    def se(self, what: str) -> float:
        binomial = se(self.mean(what), self.runs[0].n) / math.sqrt(len(self.runs))
        if len(self.runs) < 2:
            return binomial
        return max(binomial, statistics.stdev(getattr(r, what) for r in self.runs) / math.sqrt(len(self.runs)))

    @property
    def collapsed(self) -> bool:
        return 2 * sum(collapsed(r) for r in self.runs) > len(self.runs)

    def text(self) -> str:
        return (f"{self.runs[0].method} best {self.mean('best'):.3f} / final {self.mean('final'):.3f} "
                f"({len(self.runs)} seed{'s' * (len(self.runs) > 1)}){' collapsed' if self.collapsed else ''}")


def diff(x: Group, y: Group, what: str) -> tuple[float, float]:
    return x.mean(what) - y.mean(what), math.hypot(x.se(what), y.se(what))


def verdicts(runs: list, lr: float, mu: int, low_mu: int, updates: int) -> list[str]:
    g: dict[tuple[str, int], Group] = {}
    for r in runs:
        if r.lr == lr and r.updates == updates:
            g.setdefault((r.method, r.mu), Group([])).runs.append(r)

    def get(method: str, m: int = mu) -> Group | None:
        return g.get((method, m))

    def say(claim: str, needed: list, holds, detail) -> str:
        if any(x is None for x in needed):
            return f"{claim} **pending** (runs missing)."
        return f"{claim} **{'holds' if holds() else 'does not hold'}**: {detail()}."

    def below(x: Group, y: Group, what: str = "best") -> bool:
        d, s = diff(x, y, what)
        return d < -2 * s

    def d_text(x: Group, y: Group) -> str:
        return "; ".join(f"{w} {diff(x, y, w)[0]:+.3f} (2 SE {2 * diff(x, y, w)[1]:.3f})" for w in ("best", "final"))

    rel, trig, mug, grpo, hs = get("grpo-relaxed"), get("mu-grpo-trigger"), get("mu-grpo"), get("grpo", low_mu), \
        get("grpo-high-staleness")
    stable = [get(m) for m in ("mu-grpo-nontrigger-suffix", "mu-grpo-suffix", "mu-grpo")]
    out = [say("(a) Relaxed clipping [0, 5] without the veto collapses:", [rel], lambda: rel.collapsed,
               lambda: rel.text()),
           say("(b) The trigger-only veto (T) still collapses:", [trig], lambda: trig.collapsed, lambda: trig.text()),
           say("(c) The suffix scopes H_κ, S_κ and S_seq stay stable:", stable,
               lambda: not any(x.collapsed for x in stable), lambda: "; ".join(x.text() for x in stable))]
    staged = [r for r in runs if r.lr == lr and r.mu == mu and r.updates == updates]
    falls = [r for r in staged if collapsed(r)]
    near = [r for r in staged if not collapsed(r) and r.method in CLIP_RELAXED]
    out.append(say("(d) E[ρ|A<0] falls in collapsed runs and stays near 1 in stable ones:", [None] if not staged
                   else [], lambda: all(r.stage_end_ratio <= LATE_FALLS for r in falls)
                   and all(LATE_NEAR[0] < r.stage_end_ratio < LATE_NEAR[1] for r in near),
                   lambda: "collapsed: " + (", ".join(f"{r.method} s{r.seed} {r.stage_end_ratio:.3f}" for r in falls)
                                            or "none") + "; stable, clip [0, 5]: "
                   + (", ".join(f"{r.method} s{r.seed} {r.stage_end_ratio:.3f}" for r in near) or "none")))
    out.append(say(f"(e) μ-GRPO at μ = {mu} reaches standard GRPO at μ = {low_mu} within 2 SE:", [mug, grpo],
                   lambda: not below(mug, grpo), lambda: f"{mug.text()} vs {grpo.text()}: mu-grpo minus grpo "
                                                         + d_text(mug, grpo)))
    out.append(say("(f) Clipped high-staleness GRPO plateaus lower:", [hs, grpo, mug],
                   lambda: below(hs, grpo) and below(hs, mug),
                   lambda: f"{hs.text()}; minus grpo {d_text(hs, grpo)}; minus mu-grpo {d_text(hs, mug)}"))
    for m in plan.SINGLE_STAGE:
        out.append(single_stage(m, get(m, updates), get(m), updates, mu, say, below, d_text))
    t2, t6 = get("mu-grpo-tau1e-2"), get("mu-grpo-tau1e-6")
    out.append(say("(h) τ = 1e-6 stays within 2 SE of τ = 1e-4 and τ = 1e-2 is lower (Table 7):", [t2, t6, mug],
                   lambda: not below(t6, mug) and below(t2, mug),
                   lambda: f"τ 1e-6 minus 1e-4 {d_text(t6, mug)}; τ 1e-2 minus 1e-4 {d_text(t2, mug)}"))
    return out


def single_stage(m: str, one: Group | None, four: Group | None, updates: int, mu: int, say, below, d_text) -> str:
    """Claim (g) for one method: a single stage of all the updates against the staged schedule (Table 4)."""
    return say(f"(g) One stage of {updates} updates is worse than {updates // mu} x {mu} for {m} (Table 4):",
               [one, four], lambda: below(one, four),
               lambda: f"1 stage {one.text()}; {updates // mu} stages {four.text()}; one minus four "
                       + d_text(one, four))


def _f(x, spec: str) -> str:
    return format(x, spec) if isinstance(x, (int, float)) and math.isfinite(x) else "–"


def table(runs: list) -> list[str]:
    lines = ["| method | μ x stages | seed | lr | sampled pass@1 base / best / **final** | greedy best / final | "
             "learned | holds peak | collapsed | clip frac | veto seq | stage-end E[ρ\\|A<0] | p10 log ρ (A<0, min) | "
             "A<0 replies below log τ (mean) | KL max | train s | eval s |", "|" + "---|" * 17]
    for r in sorted(runs, key=lambda r: (r.lr, r.method, r.mu, r.seed)):
        p10 = min((v for v in r.series("neg_adv_log_ratio_p10")[1] if math.isfinite(v)), default=math.nan)
        m = r.s["run_mean"]
        lines.append(
            f"| {r.method} | {r.mu} x {r.stages} | {r.seed} | {r.lr:g} | {r.base:.3f} / {_f(r.best, '.3f')} / "
            f"**{r.final:.3f}** | {_f(r.greedy('best'), '.3f')} / {r.greedy('final'):.3f} | "
            f"{'yes' if learned(r) else 'no'} | {'yes' if holds_peak(r) else 'no'} | "
            f"{'**yes**' if collapsed(r) else 'no'} | {_f(r.clip_fraction, '.2e')} | "
            f"{_f(m.get('veto_sequence_fraction'), '.3f')} | {_f(r.stage_end_ratio, '.3f')} | {_f(p10, '.2f')} | "
            f"{_f(m.get('neg_adv_reply_below_tau'), '.3f')} | {_f(r.s['approx_kl_max'], '.3f')} | "
            f"{r.s['train_s']:.0f} | {r.s['eval_s']:.0f} |")
    return lines


def write_report(a, runs: list) -> None:
    from bench.lab import figures as figs

    fig_dir = a.report.parent / a.report.stem
    fig_dir.mkdir(parents=True, exist_ok=True)
    two, a = a, round_one_view(a)
    mine = [r for r in runs if r.lab_model == a.lab]
    by_name = {r.s["key"]: r for r in mine}

    def get(label: str, seed: int, lr: float, m: int | None = None):
        return by_name.get(a.key_of(label, seed, lr, m).name(a))

    gate_state, gate_detail = plan.gate(get)
    chosen, nxt, lr_log = plan.lr_search(get)
    by_hand = chosen is None and nxt is None and a.lr is not None
    if chosen is None and nxt is None:
        lr_log.append("**the registered rule found no lr**: the set stops here unless an lr is set by hand "
                      + (f"(this report: `--lr {a.lr:g}`, outside the rule)" if by_hand else "(`--plan --lr X`)"))
    chosen = a.lr if by_hand else chosen
    b = a.build
    spec = b["spec"]
    out = [
        "# The staleness lab at the paper's schedule: 4 stages x μ = 1024, sampled pass@1 (issues 34, 42, 51)", "",
        f"Generated by `{a.command}` on {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} ({platform.machine()}, "
        f"{os.cpu_count()} cores, one thread per run). Every number is read from the committed run summaries in "
        f"`{_rel(a.summaries)}/` (one JSON per finished run: config, evaluations, per-update curves).", "",
        "**To continue the set** (one run at a time per core; finished keys are skipped, a key another process is "
        "training is left to it): `PYTHONPATH=. OMP_NUM_THREADS=1 .venv/bin/python bench/fidelity.py --plan` "
        "(`--until HH:MM` stops starting runs at that UTC time; on two cores, start it in two shells: the second "
        "takes the next unclaimed key; commit `docs/fidelity-4stage*` after). "
        "While the registered lr rule has found no lr, `--plan` starts nothing: add `--lr X` (see the lr rule below). "
        "`--report-only` regenerates this file. Round two (issue 42) and round three (issue 51): "
        "`... bench/fidelity.py --round2` or `--round3` runs the registered arms still missing, in order "
        "(`--until HH:MM` as above).", "",
        *reading_first(a), "## Set-up", "",
        f"- **Lab model** (`bench/lab/model.py`, spec `{a.lab['spec']}`): Llama-shaped, {spec['num_hidden_layers']} "
        f"layers, width {spec['hidden_size']}, MLP {spec['intermediate_size']}, {spec['num_attention_heads']} heads /"
        f" {spec['num_key_value_heads']} KV heads, char tokenizer; trained in {spec['dtype']} from random weights for "
        f"{b['steps']} steps ({b['seconds']:.0f} s, one thread) until the sampled accuracy on {spec['probe_problems']}"
        f" probe problems reached {b['sampled_accuracy']:.3f} (target {spec['target_accuracy']}; greedy "
        f"{b['greedy_accuracy']:.3f}); saved in float32, weights sha256 `{a.lab['weights_sha256'][:16]}…` (the "
        "reference build, shipped in `bench/lab/pinned/`: a from-scratch build's bytes depend on the CPU).",
        f"- **Task** (`bench/lab/task.py`): {a.lab['digits']}-digit additions, column by column with carries, then "
        f"`\\boxed{{sum}}` (up to {a.spec.max_new_tokens - 8} reply tokens); replies capped at {a.max_response_len}.",
        f"- **Schedule**: {a.updates} updates of {a.prompts_per_update} prompts x {a.n_samples_per_prompt} samples "
        f"for every run; staged methods μ = {a.mu[0]} ({a.updates // a.mu[0]} stages), single stage μ = {a.updates};"
        f" `grpo` and `mu-grpo-mu4` μ = {a.low_mu}, colocated. Evaluation every {a.eval_every} updates on "
        f"{a.held_out} held-out problems: greedy, and {a.k} samples each at T = 1.", "",
        "## Rules (written before the runs)", "", plan.RULES, "",
        "## Gate", "", f"**{gate_state}**: {gate_detail}.", "",
        "## The lr rule", "", *[f"- {x}" for x in lr_log],
        f"- **lr of the set**: {chosen:g}" + (" (set by hand, not by the rule)" if by_hand else " (the rule's)")
        if chosen else "- **lr of the set**: pending"
        + (f" (next: the rule runs at {nxt:g})" if nxt else ""), "",
        *table([r for r in mine if r.mu == a.low_mu]), ""]
    if figs.accuracy_panels([r for r in mine if r.mu == a.low_mu], fig_dir / "lr_rule.png",
                            "lr rule runs: grpo and mu-grpo-mu4 at μ = 4"):
        out += [f"![lr rule runs]({fig_dir.name}/lr_rule.png)", ""]
    out += ["## Results at the set's lr", ""]
    if chosen:
        at = [r for r in mine if r.lr == chosen]
        out += [*table(at), ""]
        head = {r.method: r for r in sorted(at, key=lambda r: -r.seed) if r.mu in (a.mu[0], a.low_mu)}
        for name, methods, title in (
                ("fig2_clip.png", ("grpo", "grpo-high-staleness", "grpo-relaxed"),
                 "clip [0.8, 1.2] vs [0, 5] (Fig. 2)"),
                ("fig3_scopes.png", ("grpo-relaxed", *plan.SCOPES, "mu-grpo"), "veto scopes (Fig. 3)"),
                ("headline.png", plan.HEADLINE, "headline methods")):
            if figs.accuracy_panels([head[m] for m in methods if m in head], fig_dir / name, title):
                out += [f"![{title}]({fig_dir.name}/{name})", ""]
        out += ["## Claims (round one, as registered: best and final)", "",
                *[f"- {v}" for v in verdicts(mine, chosen, a.mu[0], a.low_mu, a.updates)], ""]
        out += r2.round_one_reading(mine, chosen, a.mu[0], a.low_mu, a.updates, fig_dir, fig_dir.name)
    else:
        out += ["Pending: no lr for the set yet, so no claim is read.", ""]
    out += ["## Plan status", ""]
    todo = plan.next_keys(a, mine) if gate_state != "fail" else []
    out += [f"Finished runs on this lab model: {len(mine)}; next in the plan: "
            + (", ".join(f"`{k.name(a).split('-lr')[0]}` lr {k.lr:g}" for k in todo[:8]) or "nothing")
            + (f" and {len(todo) - 8} more" if len(todo) > 8 else "") + ".", ""]
    rest = [r for r in mine if r.mu != a.low_mu and r.lr != chosen]
    if rest:
        out += ["## Other runs (outside the set's lr; no verdict uses them)", "", *table(rest), ""]
        if figs.accuracy_panels(rest, fig_dir / "other.png", "runs outside the set's lr"):
            out += [f"![other runs]({fig_dir.name}/other.png)", ""]
    if two is not a:
        out += r2.round_two(runs, two.lab, fig_dir, fig_dir.name)
        out += r3.round_three(runs, two.lab, fig_dir, fig_dir.name)
    other = [r for r in runs if r.lab_model not in (a.lab, two.lab)]
    if other:
        out += [f"{len(other)} summaries in the folder are from another lab model or task and are not used.", ""]
    if getattr(a, "notes", None) is not None:
        out += [f"## Reading (hand-written: `{_rel(a.notes)}`)", "", a.notes.read_text().strip(), ""]
    out += ["## History", "", HISTORY, ""]
    a.report.write_text("\n".join(out) + "\n")


HISTORY = (
    "`docs/fidelity.md` (issue 23) is the previous report, kept as it was. It was superseded because its set-up could "
    "not answer the paper's question: its μ = 1024 runs were one stage of 1024 updates (the paper runs 4 x 1024 and "
    "reports that a single stage degrades, Table 4); standard GRPO solved its 4-digit task in ~64 updates, so most "
    "of a stage trained on stale samples with nothing left to learn; it scored greedy accuracy of the final "
    "checkpoint, not sampled pass@1 of the best; its run key (method/μ/seed/lr) would read runs with other updates, "
    "stages, τ or lab model back as finished; its lr rule picked 1e-4, the edge of stability, where standard GRPO "
    "clipped ten times the paper's fraction; and its fp32 lab model build gave other weights on an Intel CPU (base "
    "greedy 0.605 against 0.48), where the μ = 1024 result at lr 3e-5 did not reproduce.")


def reading_first(a) -> list[str]:
    """The hand-written readings of rounds three and two (reading3.md, reading2.md beside the summaries), first:
    what a user should take away in the report's first lines (issues 42, 51)."""
    out = []
    for name, title in (("reading3.md", "What to take away (round three, hand-written"),
                        ("reading2.md", "Round two's reading, re-read (hand-written")):
        path = a.summaries.parent / name
        if path.exists():
            out += [f"## {title}: `{_rel(path)}`)", "", path.read_text().strip(), ""]
    return out


def round_one_view(a):
    """``a`` as round one's sections read it: its lab model is the committed set's (issue 34), whose run keys carry
    that model's checksum (bench/fidelity.py records it beside the summaries)."""
    if getattr(a, "round1_lab", a.lab) == a.lab:
        return a
    view = copy.copy(a)
    view.lab, view.build = a.round1_lab, a.round1_build
    view.key_of = functools.partial(a.key_of.func, view)
    return view


def _rel(p: Path) -> str:
    try:
        return str(Path(p).resolve().relative_to(Path(__file__).resolve().parents[2]))
    except ValueError:
        return str(p)

