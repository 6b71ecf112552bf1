"""Intervals that fit their seed count (issue 51): paired differences by seed and Student t intervals with n - 1
degrees of freedom, and a verdict that says "inconclusive" where the data cannot decide.

A paired difference d_s (method minus baseline at seed s) carries both the evaluation's sampling noise and the
run-to-run (seed) noise, so its spread over seeds is the whole noise: the interval is mean(d) ± t sd(d) / sqrt(n).
One seed has no spread to read, and its verdict is inconclusive whatever the evaluation noise alone would say.
No scipy here: the t distribution's CDF for integer degrees of freedom is the finite series of Abramowitz & Stegun
26.7.3-26.7.4, inverted by bisection.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass


def t_cdf(t: float, df: int) -> float:
    """P(T <= t) for Student's t with ``df`` (a positive integer) degrees of freedom."""
    if df < 1:
        raise ValueError(f"t_cdf: df must be >= 1, got {df}")
    theta = math.atan(abs(t) / math.sqrt(df))
    c2, s = math.cos(theta) ** 2, math.sin(theta)
    if df % 2:  # odd: A = (2/π)(θ + sinθ cosθ (1 + (2/3) cos²θ + (2·4)/(3·5) cos⁴θ + ...)), df - 2 terms after θ
        term, total = 1.0, 1.0 if df > 1 else 0.0
        for k in range(1, (df - 1) // 2):
            term *= c2 * (2 * k) / (2 * k + 1)
            total += term
        a = 2 / math.pi * (theta + s * math.cos(theta) * total)
    else:  # even: A = sinθ (1 + (1/2) cos²θ + (1·3)/(2·4) cos⁴θ + ...)
        term, total = 1.0, 1.0
        for k in range(1, df // 2):
            term *= c2 * (2 * k - 1) / (2 * k)
            total += term
        a = s * total
    return 0.5 + math.copysign(a / 2, t)


def t_quantile(p: float, df: int) -> float:
    """The t with P(T <= t) = ``p`` (0 < p < 1), to 1e-12."""
    if not 0 < p < 1:
        raise ValueError(f"t_quantile: p must be in (0, 1), got {p}")
    if p < 0.5:
        return -t_quantile(1 - p, df)
    lo, hi = 0.0, 1.0
    while t_cdf(hi, df) < p:
        hi *= 2
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if t_cdf(mid, df) < p else (lo, mid)
        if hi - lo < 1e-12:
            break
    return (lo + hi) / 2


@dataclass(frozen=True)
class Interval:
    """A two-sided ``confidence`` t interval of the mean of paired differences ``ds`` (one per seed)."""

    ds: tuple[float, ...]
    confidence: float

    @property
    def n(self) -> int:
        return len(self.ds)

    @property
    def mean(self) -> float:
        return statistics.fmean(self.ds) if self.ds else math.nan

    @property
    def half_width(self) -> float:
        """t(n-1, (1 + confidence) / 2) sd / sqrt(n); infinite with fewer than two seeds (no spread to read)."""
        if self.n < 2:
            return math.inf
        return t_quantile((1 + self.confidence) / 2, self.n - 1) * statistics.stdev(self.ds) / math.sqrt(self.n)

    @property
    def lo(self) -> float:
        return self.mean - self.half_width

    @property
    def hi(self) -> float:
        return self.mean + self.half_width

    def against(self, margin: float = 0.0) -> str:
        """'above' / 'below' the margin when the whole interval is, else 'inconclusive'."""
        if self.lo > margin:
            return "above"
        if self.hi < margin:
            return "below"
        return "inconclusive"

    def seeds_to_decide(self, margin: float = 0.0, most: int = 100) -> int | None:
        """The fewest seeds whose interval would clear ``margin`` if the mean and the seeds' SD stayed as they are
        (None: more than ``most``, or no spread to project from)."""
        if self.n < 2 or self.mean == margin:
            return None
        sd = statistics.stdev(self.ds)
        for n in range(2, most + 1):
            if t_quantile((1 + self.confidence) / 2, n - 1) * sd / math.sqrt(n) < abs(self.mean - margin):
                return n
        return None

    def text(self, margin: float = 0.0) -> str:
        seeds = ", ".join(f"{d:+.3f}" for d in self.ds)
        if self.n == 0:
            return "no paired seed yet"
        if self.n < 2:
            return f"{self.mean:+.3f} (one seed: {seeds}; no seed spread to read)"
        return (f"{self.mean:+.3f} [{self.lo:+.3f}, {self.hi:+.3f}] ({self.confidence:.0%} t, {self.n - 1} df; "
                f"seeds {seeds})")


def paired_interval(xs: list, ys: list, fn, confidence: float) -> Interval:
    """The interval of fn(x) - fn(y) over the seeds both run lists have (``curves.paired``)."""
    by = {y.seed: y for y in ys}
    return Interval(tuple(fn(x) - fn(by[x.seed]) for x in sorted(xs, key=lambda r: r.seed) if x.seed in by),
                    confidence)
