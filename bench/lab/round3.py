"""The lab report's round three (issue 51): the paper's headline at one lr (μ-GRPO at μ = 1024 x 4 against GRPO
μ = 4, both at lr 1e-5, paired seeds), the staleness curve, time to accuracy, and the held-out check of the drift
hint. Every number comes from run summaries; the rules are plan.ROUND3_RULES, registered before the runs.
"""

from __future__ import annotations

import math

from bench.lab import curves as cv
from bench.lab import figures as figs
from bench.lab import plan
from bench.lab import stats as st
from bench.lab.round2 import PAPER, _f, _mean, by_method, curve_table

DRIFT_HINT_KL = 0.03  # megamu.observability.drift's threshold, checked here on runs it was not fitted to


def _at(runs: list, method: str, lr: float, mu: int, prompts: int = 2, updates: int = 4096) -> list:
    return [r for r in runs if r.method == method and r.lr == lr and r.mu == mu and r.prompts_per_update == prompts
            and r.updates == updates and not r.s["config"].get("tag")]


def arms(runs: list) -> dict[str, list]:
    """Each round-three arm's runs (evaluated every ROUND3_EVERY updates), and B's seeds 1-2: round two's
    drift-lr1e-5 runs of the same regime (evaluated every 256 updates), as registered."""
    every = [r for r in runs if r.s["config"].get("eval_every") == plan.ROUND3_EVERY]
    lr = plan.ROUND3_LR
    b_old = [r for r in _at(runs, "mu-grpo", lr, 1024) if r.seed in (1, 2) and r not in every]
    return {
        "A": _at(every, "grpo", lr, 4),
        "B": sorted(b_old + _at(every, "mu-grpo", lr, 1024), key=lambda r: r.seed),
        "E64": _at(every, "mu-grpo", lr, 64) + _at(every, "grpo-high-staleness", lr, 64),
        "E256": _at(every, "mu-grpo", lr, 256) + _at(every, "grpo-high-staleness", lr, 256),
        "C": _at(every, "grpo", 3e-5, 4) + [r for r in runs if r.method == "grpo" and r.lr == 3e-5 and r.seed == 1
                                            and r.s["config"].get("tag") == "timed"],
        "D": _at(every, "mu-grpo", lr, 1024, prompts=8),
        "high-staleness-1024": _at(runs, "grpo-high-staleness", lr, 1024),
    }


def headline(a: list, b: list) -> tuple[st.Interval, str]:
    """The registered rule: B - A on last-stage mean, paired seeds, a two-sided t interval at HEADLINE_CONFIDENCE."""
    iv = st.paired_interval(b, a, cv.last_stage_mean, plan.HEADLINE_CONFIDENCE)
    m = plan.HEADLINE_MARGIN
    if iv.n >= 2 and iv.lo > m:
        verdict = "matches"
    elif iv.n >= 2 and iv.hi < m:
        verdict = "does not match"
    else:
        need = iv.seeds_to_decide(m)
        verdict = "inconclusive" + (f" (at this mean and spread, {need} seeds would decide it)" if need else
                                    " (no number of seeds would decide it at this mean and spread)" if iv.n >= 2
                                    else " (fewer than two paired seeds)")
    return iv, verdict


def time_ratios(a: list, b: list) -> list[str]:
    """Per seed: wall-clock to 90 % of A's last-stage mean, for A and B, and their ratio; end to end."""
    lines = ["| seed | target (0.9 x A's last-stage mean) | A s | B s | B / A | end to end B / A |",
             "|---|---|---|---|---|---|"]
    by = {r.seed: r for r in b}
    for r in sorted(a, key=lambda r: r.seed):
        x = by.get(r.seed)
        if x is None:
            continue
        target = 0.9 * cv.last_stage_mean(r)
        ta, tb = cv.time_to(r, target), cv.time_to(x, target)
        ratio = tb / ta if ta and tb is not None else math.nan
        same = "" if x.s["config"].get("eval_every") == plan.ROUND3_EVERY else " (B from round two: another sitting)"
        lines.append(f"| {r.seed}{same} | {target:.3f} | {_f(ta, '.0f')} | {_f(tb, '.0f')} | {_f(ratio, '.2f')} | "
                     f"{x.s['train_s'] / r.s['train_s']:.2f} |")
    return lines


def staleness_points(g: dict[str, list]) -> dict[str, dict[int, list]]:
    """{rule: {μ: runs}} at lr 1e-5, 2 x 8, equal data: μ-GRPO (veto + [0, 5]) and clipped GRPO ([0.8, 1.2])."""
    e = by_method(g["E64"] + g["E256"])
    mu = {"μ-GRPO": {}, "clipped GRPO": {4: g["A"], 1024: g["high-staleness-1024"]}}
    mu["μ-GRPO"][1024] = g["B"]
    for m in (64, 256):
        mu["μ-GRPO"][m] = [r for r in e.get("mu-grpo", []) if r.mu == m]
        mu["clipped GRPO"][m] = [r for r in e.get("grpo-high-staleness", []) if r.mu == m]
    return mu


def drift_check(g: dict[str, list]) -> list[str]:
    """The drift hint (median per-token KL above 0.03 in a stage after the first) on runs it was not fitted to."""
    a = {r.seed: r for r in g["A"]}
    held_out = [r for r in g["B"] + g["E64"] + g["E256"] + g["D"]
                if r.s["config"].get("eval_every") == plan.ROUND3_EVERY]
    lines = ["| run | largest stage median KL after stage 1 | hint fires | last-stage mean minus A (same seed) |",
             "|---|---|---|---|"]
    for r in held_out:
        kls = [x["kl_median"] for x in cv.stage_rows(r)[1:] if x.get("kl_median") is not None]
        worst = max(kls, default=math.nan)
        d = cv.last_stage_mean(r) - cv.last_stage_mean(a[r.seed]) if r.seed in a else math.nan
        lines.append(f"| `{r.s['key']}` | {_f(worst)} | {'yes' if worst > DRIFT_HINT_KL else 'no'} | {_f(d, '+.3f')} |")
    return lines


def round_three(runs: list, lab: dict, fig_dir, rel: str) -> list[str]:
    mine = [r for r in runs if r.lab_model == lab]
    g = arms(mine)
    out = ["## Round three: the headline at one learning rate (issue 51)", "", plan.ROUND3_RULES, "",
           "| arm | seeds | tests |", "|---|---|---|"]
    out += [f"| {arm.name} | {', '.join(map(str, arm.seeds))} | {arm.tests} |" for arm in plan.ARMS3]
    shown = sorted({r.s["key"]: r for rs in g.values() for r in rs}.values(), key=lambda r: r.s["key"])
    out += ["", "### Runs", "", *curve_table(shown, {}), ""]
    iv, verdict = headline(g["A"], g["B"])
    out += ["### The headline (registered rule)", "",
            f"μ-GRPO (μ = 1024 x 4) minus GRPO μ = 4, both at lr {plan.ROUND3_LR:g}, last-stage mean: "
            f"{iv.text(plan.HEADLINE_MARGIN)}: **{verdict}**. Paper: {PAPER['mu-grpo - grpo']}.", "",
            "### Time to accuracy (wall-clock to 90 % of A's last-stage mean)", "", *time_ratios(g["A"], g["B"]), "",
            "CPU timings of a ~0.8 M-weight model with the local engine on one core, each run beside other work on "
            f"the second core: only the direction of a ratio may carry over. Paper: {PAPER['speed']}.", "",
            "### The staleness curve (lr 1e-5, 2 x 8, equal data: 8192 prompts)", "",
            "| μ per stage | μ-GRPO last-stage mean (seeds) | clipped GRPO (seeds) | μ-GRPO minus clipped, paired |",
            "|---|---|---|---|"]
    pts = staleness_points(g)
    for mu in (4, 64, 256, 1024):
        xs, ys = pts["μ-GRPO"].get(mu, []), pts["clipped GRPO"].get(mu, [])
        d = st.paired_interval(xs, ys, cv.last_stage_mean, plan.HEADLINE_CONFIDENCE) if xs and ys else None
        out.append(f"| {mu} | {_f(_mean(map(cv.last_stage_mean, xs)))} ({len(xs)}) | "
                   f"{_f(_mean(map(cv.last_stage_mean, ys)))} ({len(ys)}) | "
                   f"{d.text() + ': ' + d.against() if d and d.n else '–'} |")
    out += ["", "μ = 4 is GRPO μ = 4 (arm A, colocated) for clipped GRPO; μ-GRPO at μ = 4 was not registered at this "
            "lr. μ = 1024 is arm B for μ-GRPO and round two's drift-lr1e-5 for clipped GRPO.", ""]
    if figs.staleness_curve(pts, fig_dir / "r3_staleness.png", f"last-stage mean against μ, lr {plan.ROUND3_LR:g}"):
        out += [f"![staleness curve]({rel}/r3_staleness.png)", ""]
    out += ["### GRPO μ = 4 at lr 3e-5 (C) and B_mini 8 x 8 at μ = 1024 (D)", "",
            "- A minus C (GRPO μ = 4, lr 1e-5 minus 3e-5): "
            + _line(st.paired_interval(g["A"], g["C"], cv.last_stage_mean, plan.HEADLINE_CONFIDENCE)),
            "- B minus C (μ-GRPO at lr 1e-5 minus GRPO μ = 4 at lr 3e-5, each at its better lr in the lab): "
            + _line(st.paired_interval(g["B"], g["C"], cv.last_stage_mean, plan.HEADLINE_CONFIDENCE)),
            "- D minus B (μ-GRPO 8 x 8 minus 2 x 8 at μ = 1024 x 4; D has 4x the data): "
            + _line(st.paired_interval(g["D"], g["B"], cv.last_stage_mean, plan.HEADLINE_CONFIDENCE)), "",
            f"### The drift hint on held-out runs (median KL > {DRIFT_HINT_KL} in a stage after the first)", "",
            *drift_check(g), ""]
    for name, keys in (("r3_headline.png", ("A", "B")), ("r3_staleness_runs.png", ("E64", "E256"))):
        runs_ = {f"{r.method} μ={r.mu}": [] for k in keys for r in g[k]}
        for k in keys:
            for r in g[k]:
                runs_[f"{r.method} μ={r.mu}"].append(r)
        if runs_ and figs.seed_mean_panels(runs_, fig_dir / name, f"round three, {' and '.join(keys)}"):
            out += [f"![{name}]({rel}/{name})", ""]
    return out


def _line(iv: st.Interval) -> str:
    return f"{iv.text()}: **{iv.against()}**" if iv.n else "not run"
