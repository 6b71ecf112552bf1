"""The lab report's curve readings (issue 42): round one's committed set re-read on whole curves, and round two's
registered arms (plan.ARMS) with their verdicts and the time to accuracy. Every number comes from run
summaries; the paper's effect sizes are quoted beside the lab's differences.
"""

from __future__ import annotations

import math
import statistics

from bench.lab import curves as cv
from bench.lab import figures as figs
from bench.lab import plan
from bench.lab import stats as st

# The paper's effect sizes, from its text (§5.1-5.2, App. C.1 and C.3), beside each comparison the lab makes.
PAPER = {
    "mu-grpo - grpo": "μ-GRPO vs GRPO μ = 4: matches or improves on 4 of 5 models, largest +2.5 points "
                      "(DeepSeek-7B 68.6 vs 66.1 %, Table 1)",
    "grpo-high-staleness - mu-grpo": "high-staleness GRPO vs μ-GRPO: -6.2 (Qwen2.5-Math-7B 41.8 vs 48.0 %) and "
                                     "-8.4 points (DeepSeek-7B 60.2 vs 68.6 %, Table 1)",
    "tau": "τ 1e-6 vs 1e-4: -0.4 points (47.6 vs 48.0 %); τ 1e-1: -2.8 (45.2 %) (Table 7)",
    "minibatch": "fixed generation budget: batch 32 44.2 % vs batch 256 41.9 %, -2.3 points (Table 3)",
    "single": "one stage of 4096 updates degrades vs μ = 512-2048 (Table 4; numbers not in the text)",
    "speed": "T_total 1.53x less on average, 2.2x on DeepSeek-7B; T_rollout 1.82x less (Table 1, Fig. 1)",
}
TABLE5 = ("Qwen2.5-Math-7B 15.24 % in stage 0, < 0.4 % after; Qwen3-1.7B-Base 7.07 %, < 0.5 % after; "
          "DeepSeek-7B < 0.7 % in every stage (vetoed tokens / all tokens of the batch)")
FRACTIONS = (0.5, 0.75, 0.9)
# Round one's and two's comparisons re-read (issue 51) with a two-sided 95 % t interval: the t analogue of the
# "2 SE" they were registered with.
REREAD_CONFIDENCE = 0.95


def _f(x, spec: str = ".3f") -> str:
    return format(x, spec) if isinstance(x, (int, float)) and math.isfinite(x) else "–"


def _mean(xs) -> float:
    xs = [x for x in xs if isinstance(x, (int, float)) and math.isfinite(x)]
    return statistics.fmean(xs) if xs else math.nan


def curve_table(runs: list, dropped: dict[str, str]) -> list[str]:
    lines = ["| run | base | best | final | **last-stage mean** | **area** | min | per-stage median KL | "
             "per-stage max KL | vetoed tokens per stage | train s |", "|" + "---|" * 11]
    for r in sorted(runs, key=lambda r: (r.method, r.mu, r.seed, r.s["key"])):
        st = cv.stage_rows(r)
        approx = "≈" if st and st[0]["approx"] else ""
        lines.append(
            f"| `{r.s['key']}` | {r.base:.3f} | {_f(r.best)} | {r.final:.3f} | **{_f(cv.last_stage_mean(r))}** | "
            f"**{_f(cv.area(r))}** | {_f(cv.minimum(r))} | {approx}{' '.join(_f(x['kl_median']) for x in st)} | "
            f"{approx}{' '.join(_f(x['kl_max']) for x in st)} | "
            f"{' '.join(_f(x.get('veto_token_fraction'), '.4f') for x in st)} | {r.s['train_s']:.0f} |")
    for k, v in sorted(dropped.items()):
        lines.append(f"| `{k}` | identical to `{v}` (same evaluations and curves): counted once | | | | | | | | | |")
    return lines


def by_method(runs: list) -> dict[str, list]:
    out: dict[str, list] = {}
    for r in runs:
        out.setdefault(r.method, []).append(r)
    return out


def diff_line(name: str, xs: list, ys: list, paper: str = "", confidence: float = REREAD_CONFIDENCE) -> str:
    """Paired per-seed differences of last-stage mean and area, with a t interval over the seeds (n - 1 degrees of
    freedom; stats): "above" / "below" where the whole interval is, else "inconclusive" (always with one
    seed). Issue 51 re-read round two this way: its "2 SE" had been the evaluation's sampling noise alone for one
    seed and |d1 - d2| / sqrt(2) for two, both narrower than the seed-to-seed spread."""
    if not xs or not ys:
        return f"- {name}: runs missing."
    ls = st.paired_interval(xs, ys, cv.last_stage_mean, confidence)
    if not ls.n:
        return f"- {name}: no seed in common (unpaired: not read)."
    ar = st.paired_interval(xs, ys, cv.area, confidence)
    return (f"- {name}: last-stage mean {ls.text()}: **{ls.against()}**; area {ar.mean:+.3f}"
            + (f". Paper: {paper}." if paper else "."))


def round_one_reading(runs: list, lr: float, mu: int, low_mu: int, updates: int, fig_dir, rel: str) -> list[str]:
    """Round one's set re-read on curves: per-run table, paired differences per claim, per-stage veto rates."""
    at = [r for r in runs if r.lr == lr and r.updates == updates and not r.s["config"].get("tag")]
    kept, dropped = cv.deduplicated(at)
    # a duplicate is listed once in the table; each method's comparison still counts it as that method's seed
    g = by_method([r for r in at if r.mu in (mu, low_mu)])
    one = by_method([r for r in at if r.mu == updates])
    out = ["## Round one re-read on curves (issue 42)", "",
           "Best and final are two points of curves that swing by ±0.15 within a stage; the columns in bold read the "
           "whole curve (definitions: `bench/lab/curves.py`). Per-stage KL is the per-token approx KL to β "
           "(≈: from the summary's 64 window medians, not every update).", "", *curve_table(kept, dropped), ""]
    out += ["### The claims on last-stage mean and area (paired by seed)", ""]
    get = g.get
    out += [diff_line("(e) mu-grpo minus grpo μ = 4", get("mu-grpo", []), get("grpo", []), PAPER["mu-grpo - grpo"]),
            diff_line("(f) grpo-high-staleness minus grpo μ = 4", get("grpo-high-staleness", []), get("grpo", [])),
            diff_line("(f) grpo-high-staleness minus mu-grpo", get("grpo-high-staleness", []), get("mu-grpo", []),
                      PAPER["grpo-high-staleness - mu-grpo"]),
            diff_line("(a) grpo-relaxed minus mu-grpo", get("grpo-relaxed", []), get("mu-grpo", [])),
            *[diff_line(f"(c) {m} minus mu-grpo (S_seq)", get(m, []), get("mu-grpo", [])) for m in plan.SCOPES],
            diff_line("(h) τ 1e-6 minus τ 1e-4", get("mu-grpo-tau1e-6", []), get("mu-grpo", []), PAPER["tau"]),
            diff_line("(h) τ 1e-2 minus τ 1e-4", get("mu-grpo-tau1e-2", []), get("mu-grpo", [])),
            diff_line("μ-GRPO at τ 1e-2 minus grpo-high-staleness", get("mu-grpo-tau1e-2", []),
                      get("grpo-high-staleness", []), PAPER["grpo-high-staleness - mu-grpo"]),
            *[diff_line(f"(g) {m}: one stage of {updates} minus 4 x {mu}", one.get(m, []), get(m, []),
                        PAPER["single"]) for m in plan.SINGLE_STAGE], ""]
    out += veto_table(g, "round one") + [""]
    for name, methods, title in (
            ("r1_headline_seeds.png", plan.HEADLINE, "round one, headline methods: seed means and ranges"),
            ("r1_scopes_seeds.png", ("grpo-relaxed", *plan.SCOPES, "mu-grpo"), "round one, veto scopes (Fig. 3)"),
            ("r1_tau_seeds.png", ("mu-grpo", "mu-grpo-tau1e-2", "mu-grpo-tau1e-6"), "round one, τ (Table 7)")):
        if figs.seed_mean_panels({m: g.get(m, []) for m in methods}, fig_dir / name, title):
            out += [f"![{title}]({rel}/{name})", ""]
    single = {f"{m} 1 x {updates}": one.get(m, []) for m in plan.SINGLE_STAGE}
    single.update({f"{m} 4 x {mu}": g.get(m, []) for m in plan.SINGLE_STAGE})
    if figs.seed_mean_panels(single, fig_dir / "r1_single_stage_seeds.png", "round one, one stage vs four (Table 4)"):
        out += [f"![single stage]({rel}/r1_single_stage_seeds.png)", ""]
    if dropped:
        out += ["Duplicates: " + "; ".join(f"`{k}` = `{v}`" for k, v in dropped.items()) + " (same evaluations and "
                "training curves: where the veto never fires, the run is the no-veto run). Listed once in the table; "
                "each method's comparison still counts it as its own seed, and a pooled list such as claim (d) "
                "should count it once.", ""]
    return out


def veto_table(groups: dict[str, list], label: str) -> list[str]:
    """Per-stage veto rates of the veto methods (seed means) beside Table 5."""
    lines = [f"### Veto per stage, {label} (seed means; Table 5: {TABLE5})", "",
             "| method | vetoed tokens per stage | replies masked per stage | A<0 replies below log τ per stage | "
             "median KL per stage |", "|---|---|---|---|---|"]
    for m, rs in sorted(groups.items()):
        rows = [cv.stage_rows(r) for r in rs if r.mu > 4]  # the staged veto runs (μ = 4 runs veto nothing here)
        if not rows or not m.startswith("mu-grpo"):
            continue
        n = min(len(x) for x in rows)

        def col(key: str, spec: str, n: int = n, rows: list = rows) -> str:
            return " / ".join(_f(_mean(st[i].get(key) for st in rows), spec) for i in range(n))

        lines.append(f"| {m} | {col('veto_token_fraction', '.2%')} | {col('veto_sequence_fraction', '.2%')} | "
                     f"{col('neg_adv_reply_below_tau', '.2%')} | {col('kl_median', '.3f')} |")
    return lines


def time_to_accuracy(runs: list) -> list[str]:
    """Per seed: GRPO μ = 4's best, and each timed run's wall-clock to fractions of it."""
    g = by_method(runs)
    grpo = {r.seed: r for r in g.get("grpo", [])}
    if not grpo:
        return ["Time to accuracy: pending (no timed grpo μ = 4 run yet)."]
    lines = ["| run | " + " | ".join(f"s to {f:.0%} of grpo's best" for f in FRACTIONS) + " | total train s |",
             "|" + "---|" * (len(FRACTIONS) + 2)]
    ratios: dict[str, list[str]] = {}
    for r in sorted(runs, key=lambda r: (r.seed, r.method)):
        ref = grpo.get(r.seed)
        if ref is None:
            continue
        ts = [cv.time_to(r, f * ref.best) for f in FRACTIONS]
        lines.append(f"| `{r.s['key']}` | " + " | ".join(_f(t, ".0f") for t in ts) + f" | {r.s['train_s']:.0f} |")
        if r.method.startswith("mu-grpo"):
            t0s = [cv.time_to(ref, f * ref.best) for f in FRACTIONS]
            ratios[f"{r.method} s{r.seed}"] = [
                f"{f:.0%}: " + (f"{t / t0:.2f}" if t is not None and t0 else "not reached")
                for f, t, t0 in zip(FRACTIONS, ts, t0s)] + [f"end to end: {r.s['train_s'] / ref.s['train_s']:.2f}"]
    lines += ["", "Ratio to GRPO μ = 4's wall-clock, same seed (< 1: faster), to the same accuracy and end to end at "
              "equal samples: " + "; ".join(f"{k}: {', '.join(v)}" for k, v in ratios.items())
              + f". Paper: {PAPER['speed']}. These are CPU timings of a ~0.8 M-weight model with the local engine on "
              "one core, each run sharing the machine with other work on the second core, not the paper's GPU "
              "timings: only the direction of a ratio may carry over, and not necessarily."]
    return lines


def round_two(runs: list, lab: dict, fig_dir, rel: str) -> list[str]:
    """Round two's arms on the shipped model: runs, verdicts, time to accuracy, figures."""
    mine = [r for r in runs if r.lab_model == lab]
    out = ["## Round two: the registered arms (issue 42)", "", plan.ROUND2_RULES, "",
           "| arm | tests | implicates if | clears if |", "|---|---|---|---|"]
    out += [f"| {a.name} | {a.tests} | {a.implicates} | {a.clears} |" for a in plan.ARMS]
    out += [""]
    if not mine:
        return out + ["No round-two run has finished yet.", ""]
    kept, dropped = cv.deduplicated(mine)
    out += ["### Runs", "", *curve_table(mine, dropped), ""]
    arms = {a.name: [r for r in kept if _in_arm(r, a)] for a in plan.ARMS}
    base = by_method(arms["baseline"])
    out += ["### Verdicts", ""]
    for a in plan.ARMS:
        rs = by_method(arms[a.name])
        if not arms[a.name]:
            out.append(f"- **{a.name}**: not run (cut for time: seeds are cut before arms, and this sitting ended "
                       "before it).")
            continue
        if a.name == "baseline":
            lines = [diff_line("mu-grpo minus grpo μ = 4", rs.get("mu-grpo", []), rs.get("grpo", []),
                               PAPER["mu-grpo - grpo"]),
                     diff_line("grpo-high-staleness minus mu-grpo", rs.get("grpo-high-staleness", []),
                               rs.get("mu-grpo", []), PAPER["grpo-high-staleness - mu-grpo"])]
        elif a.name == "tau-by-veto-rate":
            t = rs.get(plan.TAU_RULE_METHOD, [])
            stage1 = _mean(cv.stage_rows(r)[0].get("veto_token_fraction") for r in t)
            in_band = plan.TABLE5_STAGE0[0] <= stage1 <= plan.TABLE5_STAGE0[1]
            lines = [f"- stage-1 vetoed tokens {_f(stage1, '.2%')}: "
                     + ("in Table 5's band" if in_band else "**outside Table 5's band: the rule missed**"),
                     diff_line("τ rule minus grpo-high-staleness (baseline)", t, base.get("grpo-high-staleness", [])),
                     diff_line("τ rule minus τ 1e-4 (baseline mu-grpo)", t, base.get("mu-grpo", []), PAPER["tau"])]
        elif a.name == "grpo-32x8":  # read against minibatch-32x8's runs: the same data, B_mini and seeds
            b32 = by_method(arms["minibatch-32x8"])
            lines = [diff_line("minibatch-32x8's mu-grpo minus grpo μ = 4 at 32 x 8", b32.get("mu-grpo", []),
                               rs.get("grpo", []), PAPER["mu-grpo - grpo"]),
                     diff_line("minibatch-32x8's grpo-high-staleness minus grpo μ = 4 at 32 x 8",
                               b32.get("grpo-high-staleness", []), rs.get("grpo", []))]
        else:
            lines = [diff_line(f"{a.name}: mu-grpo minus grpo-high-staleness", rs.get("mu-grpo", []),
                               rs.get("grpo-high-staleness", []), PAPER["minibatch"] if "minibatch" in a.name
                               else ""),
                     diff_line("baseline (2 x 8, lr 3e-5): mu-grpo minus grpo-high-staleness", base.get("mu-grpo", []),
                               base.get("grpo-high-staleness", []))]
            if a.name.startswith("drift"):
                kl = _mean(x["kl_median"] for r in rs.get("mu-grpo", []) for x in cv.stage_rows(r))
                kl0 = _mean(x["kl_median"] for r in base.get("grpo-high-staleness", []) for x in cv.stage_rows(r))
                lines.append(f"- mu-grpo's per-stage median KL at lr 1e-5: {_f(kl)} (baseline grpo-high-staleness "
                             f"at 3e-5: {_f(kl0)})")
        out += [f"- **{a.name}** ({', '.join(f'{m} x{len(v)}' for m, v in sorted(rs.items()))}):"]
        out += ["  " + x for x in lines]
    timed = [r for r in kept if r.s["config"].get("tag") == "timed"]
    out += ["", *veto_table({**base, **by_method(arms["tau-by-veto-rate"])}, "round two, 2 x 8"), "",
            "### Time to accuracy (the timed runs of one sitting: baseline and τ arms)", "", *time_to_accuracy(timed),
            ""]
    for a in plan.ARMS:
        shown = {**by_method(arms["minibatch-32x8"]), **by_method(arms[a.name])} if a.name == "grpo-32x8" \
            else by_method(arms[a.name])
        if arms[a.name] and figs.seed_mean_panels(shown, fig_dir / f"r2_{a.name}.png",
                                                  f"round two, {a.name}"):
            out += [f"![{a.name}]({rel}/r2_{a.name}.png)", ""]
    return out


def _in_arm(r, a) -> bool:
    c = r.s["config"]
    mu_ok = r.mu == (4 if r.method == "grpo" else a.mu)
    return (r.method in a.methods and mu_ok and r.lr == a.lr and r.updates == a.updates
            and r.prompts_per_update == a.prompts and c.get("tag", "") == a.tag)
