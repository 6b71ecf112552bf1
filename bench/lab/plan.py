"""The pre-registered run set of the 4-stage lab (issue 34) and the two rules that gate it: the task gate and the lr
rule. Written down before the runs they judge (RULES is printed in the report); bench/fidelity.py --plan follows it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

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


# --- round two (issue 42): why μ-GRPO loses to plain GRPO in the lab. Registered before any of its runs. ----------
ROUND2_LR = 3e-5  # the set's lr (by hand, issue 34): every arm changes one thing against the committed set
# Table 5's stage-0 vetoed-token fractions of the models that start weak (App. C.1): Qwen3-1.7B-Base 7.07 %,
# Qwen2.5-Math-7B 15.24 %. The τ rule aims at their geometric middle.
TABLE5_STAGE0 = (0.0707, 0.1524)
VETO_TARGET = math.sqrt(TABLE5_STAGE0[0] * TABLE5_STAGE0[1])
TAU_RULE_METHOD = "mu-grpo-tau3e-3"  # bench/fidelity.py's method at the τ tau_by_veto_rate gave (checked at --round2)


def stage_mean(r, key: str, stage: int) -> float:
    """Mean of a per-update curve over one stage (0-based): the curve's equal windows split evenly into stages."""
    xs, ys = r.series(key)
    per = len(xs) // r.stages
    vals = [v for v in ys[stage * per:(stage + 1) * per] if math.isfinite(v)]
    return sum(vals) / len(vals) if vals else math.nan


def tau_by_veto_rate(runs) -> tuple[float, str]:
    """(τ, how): the τ whose stage-1 vetoed-token fraction is VETO_TARGET, interpolated log-log between the seeds'
    mean stage-1 fractions of the committed `mu-grpo` (τ = 1e-4) and `mu-grpo-tau1e-2` runs at ROUND2_LR, 4 x 1024,
    rounded to one significant digit. Log-log: the fraction rises ~25x over those two decades of τ, so a linear
    interpolation would be dominated by the upper point."""
    def rate(method: str) -> float:
        rs = [r for r in runs if r.method == method and r.lr == ROUND2_LR and r.mu == 1024 and r.stages == 4
              and r.prompts_per_update == 2 and not r.s["config"].get("tag")]
        if not rs:
            raise ValueError(f"tau_by_veto_rate: no committed {method} run at lr {ROUND2_LR:g}, 4 x 1024")
        return sum(stage_mean(r, "veto_token_fraction", 0) for r in rs) / len(rs)

    lo, hi = rate("mu-grpo"), rate("mu-grpo-tau1e-2")
    slope = (math.log10(hi) - math.log10(lo)) / (math.log10(1e-2) - math.log10(1e-4))
    exact = 10 ** (math.log10(1e-4) + (math.log10(VETO_TARGET) - math.log10(lo)) / slope)
    tau = float(f"{exact:.0e}")
    return tau, (f"stage-1 vetoed tokens {lo:.4f} at τ 1e-4 and {hi:.4f} at τ 1e-2 (seed means); target "
                 f"{VETO_TARGET:.4f}: τ {exact:.2e}, rounded {tau:g}")


@dataclass(frozen=True)
class Arm:
    """One experiment of round two: ``methods`` at one regime, what it changes, and what would implicate or clear
    the explanation it tests."""

    name: str
    methods: tuple[str, ...]
    prompts: int = 2  # prompts per update (x 8 samples = B_mini)
    mu: int = 1024
    updates: int = 4096
    lr: float = ROUND2_LR
    tag: str = ""  # keys of its own: not read back from the committed set (bench/lab/driver.py RunKey.tag)
    tests: str = ""
    implicates: str = ""
    clears: str = ""
    seeds: tuple[int, ...] = (1, 2)  # round three's arms name their seeds (ROUND3_ORDER runs them)


PAIR = ("mu-grpo", "grpo-high-staleness")
ARMS = (
    Arm("baseline", ("grpo", "mu-grpo", "grpo-high-staleness"), tag="timed",
        tests="the committed set's headline regime (B_mini 2 x 8, μ = 1024 x 4, τ = 1e-4, lr 3e-5) on the shipped lab "
              "model, timed: every other arm is read against these runs of the same sitting; and the paper's speed "
              "claim: wall-clock (rollout + training + syncs) to fixed fractions of GRPO μ = 4's best accuracy, "
              "GRPO μ = 4 colocated vs μ-GRPO staged (grpo runs at μ = 4)",
        implicates="(a measurement) μ-GRPO reaches a fraction of GRPO μ = 4's accuracy sooner than GRPO μ = 4",
        clears="μ-GRPO reaches no fraction, or reaches it later"),
    Arm("tau-by-veto-rate", (TAU_RULE_METHOD,), tag="timed",
        tests="τ rescaled to the task: τ set by tau_by_veto_rate so that stage 1 masks what Table 5 reports for "
              "stage 0 of the models that start weak, against τ = 1e-4 (baseline's mu-grpo)",
        implicates="at that τ μ-GRPO reaches baseline high-staleness GRPO's last-stage mean (within 2 SE or above) "
                   "and its stage-1 vetoed-token fraction lands in Table 5's 7-15 %",
        clears="μ-GRPO at that τ stays below high-staleness GRPO by more than 2 SE (a stage-1 fraction outside "
               "7-15 % means the rule missed, and the arm is inconclusive)"),
    Arm("minibatch-8x8", PAIR, prompts=8, mu=256, updates=1024,
        tests="B_mini 2 x 8 vs the paper's 32 x 8, at equal data (Table 3's fixed generation budget): 4 stages of "
              "2048 prompts, B_mini 8 x 8, μ = 256",
        implicates="μ-GRPO's last-stage mean reaches high-staleness GRPO's at the same seed (within 2 SE or above), "
                   "where at 2 x 8 (baseline) it was below",
        clears="μ-GRPO stays below high-staleness GRPO by more than 2 SE on last-stage mean, as at 2 x 8"),
    Arm("drift-lr1e-5", PAIR, lr=1e-5,
        tests="drift per stage: lr 1e-5 at 2 x 8, μ = 1024 x 4 (round one: μ-GRPO's median per-token KL per stage "
              "was 3-5x high-staleness GRPO's at 3e-5)",
        implicates="μ-GRPO's per-stage median KL falls to baseline high-staleness GRPO's range and its last-stage "
                   "mean reaches high-staleness GRPO's at the same lr (within 2 SE or above)",
        clears="μ-GRPO stays below high-staleness GRPO at the same lr by more than 2 SE"),
    Arm("minibatch-32x8", PAIR, prompts=32, mu=64, updates=256,
        tests="B_mini 32 x 8 (the paper's), μ = 64, at equal data: 4 stages of 2048 prompts",
        implicates="as minibatch-8x8", clears="as minibatch-8x8"),
    Arm("minibatch-8x8-mu1024", PAIR, prompts=8, mu=1024, updates=4096,
        tests="B_mini 8 x 8 at the paper's staleness μ = 1024 x 4 (4x the data and compute of the set)",
        implicates="μ-GRPO at or above high-staleness GRPO", clears="μ-GRPO below by more than 2 SE"),
    # Registered 2026-12-07 01:58 UTC, after the second sitting (whose reading proposed it) and before any run of it.
    Arm("grpo-32x8", ("grpo",), prompts=32, mu=64, updates=256,
        tests="the paper's like-for-like (e): GRPO μ = 4 (colocated, clip 0.2) at B_mini 32 x 8, the same data as "
              "minibatch-32x8 (8192 prompts), against that arm's μ-GRPO at the same seed",
        implicates="(for claim e) μ-GRPO's last-stage mean within 2 SE of GRPO μ = 4's at 32 x 8: it matches",
        clears="μ-GRPO below GRPO μ = 4 at 32 x 8 by more than 2 SE: it does not match at the paper's B_mini"),
)
# Seeds are cut before arms: every arm's seed 1 runs before any seed 2. The one-run τ arm was moved before the
# two-run B_mini arm a minute into the first run of the sitting (no run of either had started), so that a sitting of
# ~6 runs reaches one more arm.
ROUND2_SEEDS = (1, 2)

ROUND2_RULES = """\
- Registered in bench/lab/plan.py (`ARMS`) before any of its runs, on the lab model shipped in
  bench/lab/pinned/ (round one's model could not be rebuilt on this machine: bench/lab/model.py). The `baseline` arm
  reruns the committed set's headline regime (lr 3e-5, B_mini 2 x 8, μ = 1024 x 4, τ = 1e-4) on it; every other arm
  changes one thing against it and compares methods at the same seed, which see the same stage-1 rollouts where
  their stage-1 datasets are the same (paired), in the same sitting on one machine.
- Curves, not two points: *last-stage mean* = mean of the evaluations in the last quarter of the run's samples (the
  final stage of a 4-stage run; the same window for μ = 4 runs), *area* = mean of every evaluation after update 0,
  *min* = the lowest evaluation after update 0. Differences are paired per seed; 2 SE of a difference of two runs'
  last-stage means is 2 sqrt(2) SE_nk of the window's mean (SE_nk over n problems x k samples x evaluations).
- Run order: arm by arm in the order listed, seed 1 of every arm first, then seed 2; a sitting that runs out of time
  cuts seeds before arms and says so.
- Time to accuracy: per run, the trainer's wall-clock at the first evaluation whose sampled accuracy reaches
  50 / 75 / 90 % of GRPO μ = 4's best (same sitting, same seed); ratio μ-GRPO / GRPO μ = 4. CPU timings with a
  ~0.8 M-weight model, not the paper's GPU timings.
- τ rule (`tau_by_veto_rate`): computed on round one's committed runs, before round two; the `tau-by-veto-rate` arm
  checks that its stage-1 fraction does land in 7-15 % on the shipped model."""


def round2_keys(a, runs) -> list:
    """The round-two runs still to do, in the registered order (seed 1 of every arm, then seed 2); with ``a.arms``,
    only those arms (a sitting that cannot afford the whole order says which arms it skips)."""
    have = {r.s["key"] for r in runs}
    keys = []
    for seed in ROUND2_SEEDS:
        for arm in ARMS:
            if getattr(a, "arms", None) and arm.name not in a.arms:
                continue
            for label in arm.methods:
                low = label == "grpo"
                k = a.key_of(label, seed, arm.lr, None if low else arm.mu, arm.prompts, arm.updates, arm.tag)
                if k.name(a) not in have:
                    keys.append(k)
    return keys


# --- round three (issue 51): the paper's headline at one lr. Registered 2026-12-07 ~07:00 UTC, before any run of it. -
ROUND3_LR = 1e-5  # μ-GRPO's best lr in round two (drift-lr1e-5); the paper compares both rules at one lr
ROUND3_EVERY = 128  # updates between evaluations in every round-three run
HEADLINE_MARGIN = -0.03  # "matches": μ-GRPO at most 3 points below GRPO μ = 4 (the lower bound of the interval)
HEADLINE_CONFIDENCE = 0.90
ARMS3 = (
    Arm("A-grpo-lr1e-5", ("grpo",), lr=ROUND3_LR, seeds=(1, 2, 3, 4),
        tests="GRPO μ = 4 (colocated, clip 0.2) at lr 1e-5, 2 x 8, 4096 updates, on the shipped lab model: the "
              "paper's baseline at μ-GRPO's lr"),
    Arm("B-mu-grpo-lr1e-5", ("mu-grpo",), lr=ROUND3_LR, seeds=(3, 4),
        tests="μ-GRPO at μ = 1024 x 4, lr 1e-5, 2 x 8: seeds 3-4; seeds 1-2 are drift-lr1e-5's committed runs (the "
              "same run but evaluated every 256 updates)"),
    Arm("E-staleness-mu64", PAIR, mu=64, lr=ROUND3_LR,
        tests="the staleness curve: μ-GRPO and clipped high-staleness GRPO at μ = 64 per stage (64 stages), "
              "equal data"),
    Arm("E-staleness-mu256", PAIR, mu=256, lr=ROUND3_LR,
        tests="the staleness curve at μ = 256 per stage (16 stages), equal data"),
    Arm("C-grpo-lr3e-5", ("grpo",), seeds=(2, 3, 4),
        tests="GRPO μ = 4 at lr 3e-5 on the shipped model (seed 1 is round two's timed baseline run)"),
    Arm("D-mu-grpo-8x8-mu1024", ("mu-grpo",), prompts=8, lr=ROUND3_LR,
        tests="B_mini 8 x 8 without changing μ (1024 x 4; 4x the data of the 2 x 8 runs), against B at the same seed"),
)
# The sitting's order: the headline's pairs first (a seed of A beside the B it pairs with), then E, C, D; seeds are
# cut before arms.
ROUND3_ORDER = (("A-grpo-lr1e-5", 1), ("A-grpo-lr1e-5", 2), ("B-mu-grpo-lr1e-5", 3), ("A-grpo-lr1e-5", 3),
                ("B-mu-grpo-lr1e-5", 4), ("A-grpo-lr1e-5", 4),
                ("E-staleness-mu64", 1), ("E-staleness-mu256", 1), ("E-staleness-mu64", 2), ("E-staleness-mu256", 2),
                ("C-grpo-lr3e-5", 2), ("C-grpo-lr3e-5", 3), ("C-grpo-lr3e-5", 4),
                ("D-mu-grpo-8x8-mu1024", 1), ("D-mu-grpo-8x8-mu1024", 2))

ROUND3_RULES = f"""\
- Registered in bench/lab/plan.py (`ARMS3`, `ROUND3_ORDER`) before any of its runs, on the shipped lab model;
  every round-three run is evaluated every {ROUND3_EVERY} updates.
- **Headline rule** (μ-GRPO matches GRPO μ = 4 at one lr, lr {ROUND3_LR:g}): d_s = B's last-stage mean minus A's at
  seed s, s = 1..4; the interval is mean(d) ± t(n-1, 0.95) sd(d) / sqrt(n), a two-sided
  {HEADLINE_CONFIDENCE:.0%} t interval over the n paired seeds (seed and evaluation noise both sit in d's spread).
  **matches** if its lower bound is above {HEADLINE_MARGIN}, **does not match** if its upper bound is below
  {HEADLINE_MARGIN}, else **inconclusive**, with the seeds that would decide it at the same mean and spread. If B
  does not match A, the staleness curve (E) says from which μ on μ-GRPO falls behind.
- Time to accuracy: wall-clock (the trainer's, rollout and syncs included) to the first evaluation at 90 % of A's
  last-stage mean at the same seed; ratio B / A. A and B run one after the other on one core, beside other work on
  the second core: their clocks compare only roughly.
- Every other comparison uses the same paired-seed t interval; with one seed (no seed spread to read) the verdict
  is **inconclusive** whatever the evaluation noise says."""


def round3_keys(a, runs) -> list:
    """The round-three runs still to do, in ROUND3_ORDER (with ``a.arms``, only those arms)."""
    have = {r.s["key"] for r in runs}
    arms = {arm.name: arm for arm in ARMS3}
    keys = []
    for name, seed in ROUND3_ORDER:
        arm = arms[name]
        if getattr(a, "arms", None) and name not in a.arms:
            continue
        for label in arm.methods:
            low = label == "grpo"
            k = a.key_of(label, seed, arm.lr, None if low else arm.mu, arm.prompts, arm.updates, "", ROUND3_EVERY)
            if k.name(a) not in have:
                keys.append(k)
    return keys
