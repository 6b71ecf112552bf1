"""The pre-registered run set of the 4-stage lab (issue 34) and the two rules that gate it: the task gate and the lr
rule. Written down before the runs they judge (RULES is printed in the report); bench/fidelity.py --plan follows it.
"""

from __future__ import annotations

import math

# --- the rules, fixed before the runs ---------------------------------------------------------------------------
CLIP_BAND = (2e-4, 1e-3)  # standard GRPO's clip fraction at μ = 4, around the paper's 4e-4 (Table 9)
LR_START = 3e-5  # where the 4-digit lab's GRPO clipped 4-6e-4 of tokens (docs/fidelity.md)
LR_UP = {3e-5: 1e-4}  # tried after a pass: the rule takes the largest candidate that passes
LR_DOWN = {3e-5: 1e-5}  # tried after a fail
RULE_RUNS = (("grpo", 1), ("grpo", 2), ("mu-grpo-mu4", 1), ("mu-grpo-mu4", 2))
HEADLINE = ("grpo", "grpo-high-staleness", "grpo-relaxed", "mu-grpo")
SCOPES = ("mu-grpo-trigger", "mu-grpo-nontrigger-suffix", "mu-grpo-suffix")
TAUS = ("mu-grpo-tau1e-2", "mu-grpo-tau1e-6")
SINGLE_STAGE = ("grpo-relaxed", "mu-grpo")

RULES = f"""\
- *accuracy*: sampled pass@1 on the n held-out problems, k samples each at T = 1 (one fixed sampling seed for every
  checkpoint); *best* is over the evaluations after update 0, *final* the last one. Greedy accuracy is reported too.
- *SE(p)* = sqrt(p (1 - p) / n) over the n problems (conservative: a problem's k samples are correlated);
  *SE_nk(p)* = sqrt(p (1 - p) / (n k)), the sampling noise of one checkpoint's pass@1.
- **learned**: best >= base + 2 SE(base). **collapsed**: final < base - 3 SE(base), or final < best / 2.
  **holds its peak**: final >= best - 2 SE(best).
- **Gate** (the task has headroom): `grpo` at μ = 4, seed 1, at an lr whose run has a mean clip fraction in
  [{CLIP_BAND[0]:g}, {CLIP_BAND[1]:g}], is still improving past half its updates: its best accuracy after update
  U/2 exceeds its best up to U/2 by more than 2 SE_nk of the latter. The gate is read on the first lr candidate
  whose clip fraction is in the band; if it fails there, the plan stops (the task is too easy; no other run starts).
- **lr rule**: a candidate lr *passes* when `grpo` (μ = 4) on seeds 1 and 2 has a mean clip fraction in
  [{CLIP_BAND[0]:g}, {CLIP_BAND[1]:g}] and `grpo` and `mu-grpo-mu4` (μ = 4, App. C.4) on seeds 1 and 2 each learned
  and hold their peak; it *fails* at the first of these runs that does not. Candidates in order: {LR_START:g}; after
  a pass {LR_UP[LR_START]:g} (the larger passing lr is taken), after a fail {LR_DOWN[LR_START]:g}. If neither
  candidate after {LR_START:g} resolves it, the rule has no lr and the set stops.
- Claims, at the rule's lr, μ = 1024 x 4 stages, every accuracy the seeds' mean; the SE of a mean is the larger of
  SE / sqrt(seeds) and the seeds' standard error; a method collapsed when most of its seeds did:
  (a) `grpo-relaxed` collapses; (b) `mu-grpo-trigger` (T) collapses; (c) none of `mu-grpo-nontrigger-suffix` (H_κ),
  `mu-grpo-suffix` (S_κ), `mu-grpo` (S_seq) collapses; (d) every collapsed staged run's stage-end E[ρ|A<0] is
  <= 0.8 and every stable staged run with clip [0, 5] has it in (0.8, 1.25); (e) `mu-grpo`'s best >= `grpo` μ = 4's
  best - 2 SE of the difference; (f) `grpo-high-staleness`'s best is below both `grpo`'s and `mu-grpo`'s by more
  than 2 SE of the difference; (g, Table 4) one stage of 4096 updates is worse than 4 x 1024: for `grpo-relaxed`
  and for `mu-grpo`, best(1 x 4096) < best(4 x 1024) by more than 2 SE of the difference (read per method);
  (h, Table 7) `mu-grpo` at τ = 1e-6 is within 2 SE of τ = 1e-4 (best), and τ = 1e-2 is below τ = 1e-4 by more
  than 2 SE. The same tests on final accuracy are printed beside them for reading.
- A claim whose runs are missing is *pending*."""


def se(p: float, n: int) -> float:
    p = min(max(p, 1 / n), 1 - 1 / n)
    return math.sqrt(p * (1 - p) / n)


def learned(r) -> bool:
    return r.best >= r.base + 2 * se(r.base, r.n)


def collapsed(r) -> bool:
    return r.final < r.base - 3 * se(r.base, r.n) or r.final < r.best / 2


def holds_peak(r) -> bool:
    return r.final >= r.best - 2 * se(r.best, r.n)


def in_band(r) -> bool:
    return CLIP_BAND[0] <= r.clip_fraction <= CLIP_BAND[1]


def still_improving(r) -> tuple[bool, float, float]:
    """(gate passes, best up to U/2, best after U/2) on sampled accuracy."""
    half = r.updates / 2
    early = max((e["sampled"] for e in r.s["evals"][1:] if e["update"] <= half), default=math.nan)
    late = max((e["sampled"] for e in r.s["evals"] if e["update"] > half), default=math.nan)
    return late - early > 2 * se(early, r.n * r.k), early, late


def candidate(get, lr: float) -> tuple[str, list[str]]:
    """'pass', 'fail' or 'pending' for one lr, and why, from the finished rule runs (``get(label, seed, lr)``)."""
    why, pending = [], False
    for label, seed in RULE_RUNS:
        r = get(label, seed, lr)
        if r is None:
            pending = True
            continue
        bad = [x for x, ok in (("clip fraction out of band", label != "grpo" or in_band(r)),
                               ("did not learn", learned(r)), ("did not hold its peak", holds_peak(r))) if not ok]
        why.append(f"{label} s{seed}: clip {r.clip_fraction:.2e}, best {r.best:.3f}, final {r.final:.3f}"
                   + (f" ({', '.join(bad)})" if bad else ""))
        if bad:
            return "fail", why
    return ("pending" if pending else "pass"), why


def lr_search(get) -> tuple[float | None, float | None, list[str]]:
    """(chosen lr, lr whose rule runs are to run next, the log), following the candidate order above."""
    log = []
    first, why = candidate(get, LR_START)
    log.append(f"lr {LR_START:g}: {first}" + (f" ({'; '.join(why)})" if why else ""))
    if first == "pending":
        return None, LR_START, log
    nxt = (LR_UP if first == "pass" else LR_DOWN)[LR_START]
    second, why = candidate(get, nxt)
    log.append(f"lr {nxt:g}: {second}" + (f" ({'; '.join(why)})" if why else ""))
    if second == "pending":
        return None, nxt, log
    if second == "pass":
        return nxt, None, log
    return (LR_START if first == "pass" else None), None, log


def gate(get) -> tuple[str, str]:
    """('pass' | 'fail' | 'pending', detail): the gate on grpo seed 1 at the first candidate in the clip band."""
    for lr in (LR_START, LR_UP[LR_START], LR_DOWN[LR_START]):  # the plan runs only those on the search path
        r = get("grpo", 1, lr)
        if r is not None and in_band(r):
            ok, early, late = still_improving(r)
            return ("pass" if ok else "fail"), (f"grpo s1 at lr {lr:g}: clip fraction {r.clip_fraction:.2e}, best "
                                                f"sampled up to update {r.updates // 2} {early:.3f}, after {late:.3f}"
                                                f" (2 SE_nk = {2 * se(early, r.n * r.k):.3f})")
    return "pending", "no finished grpo s1 run with its clip fraction in the band yet"


def next_keys(a, runs) -> list:
    """The runs to do next, in order, given the finished ones (bench/fidelity.py trains the first unclaimed)."""
    by_name = {r.s["key"]: r for r in runs}

    def get(label: str, seed: int, lr: float, m: int | None = None):
        return by_name.get(a.key_of(label, seed, lr, m).name(a))

    if gate(get)[0] == "fail":
        return []
    chosen, nxt, _ = lr_search(get)
    if chosen is None and nxt is None and a.lr is not None:  # the rule found none: an lr set by hand, reported so
        chosen = a.lr
        rule = [(label, seed) for label, seed in RULE_RUNS if get(label, seed, chosen) is None]
        if rule:  # its App. C.4 runs first, so the report shows whether μ = 4 holds at it
            return [a.key_of(label, seed, chosen) for label, seed in rule]
    if nxt is not None:
        return [a.key_of(label, seed, nxt) for label, seed in RULE_RUNS if get(label, seed, nxt) is None]
    if chosen is None:
        return []
    want = [(label, s, None) for s in (1, 2, 3) for label in HEADLINE]
    want += [(label, s, None) for s in (1, 2, 3) for label in SCOPES]
    want += [(label, s, None) for s in (1, 2) for label in TAUS]
    want += [(label, s, a.updates) for s in (1, 2) for label in SINGLE_STAGE]
    return [a.key_of(label, s, chosen, m) for label, s, m in want if get(label, s, chosen, m) is None]
