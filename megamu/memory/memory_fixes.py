"""What to change when a memory plan does not fit: each setting that, changed alone, makes every phase fit.

Pure arithmetic on ``MemoryPlanConfig`` (replanned with ``plan_memory``); the caller names the flags (fields are
the config's, e.g. ``max_tokens_per_micro_batch``, ``release_during_training``)."""

from __future__ import annotations

from dataclasses import replace

from megamu.errors import ConfigError
from megamu.memory.memory_plan import MemoryPlanConfig, plan_memory
from megamu.mode import mode_of

ROUND_TOKENS = 256  # a suggested token budget is a multiple of this (and at least one row)


def fits(c: MemoryPlanConfig) -> bool:
    plan = plan_memory(c)
    try:
        plan.check()
    except ConfigError:
        return False
    return True


def _largest(c: MemoryPlanConfig, field: str, low: int, high: int, step: int = 1) -> int | None:
    """The largest value in [low, high] (multiples of ``step`` above ``low``) of ``field`` at which ``c`` fits; the
    plan grows with it, so a bisection."""
    def ok(v: int) -> bool:
        return fits(replace(c, **{field: v}))

    if high < low or not ok(low):
        return None
    lo, hi = 0, (high - low) // step  # ok(low + lo * step) holds
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if ok(low + mid * step) else (lo, mid - 1)
    return low + lo * step


def fixes(c: MemoryPlanConfig) -> list[tuple[str, object]]:
    """(field, value) pairs, each of which alone makes ``c`` fit: a token budget (the largest that fits, at least one
    row), fewer rows per micro-batch, full recompute, servers released while the trainer trains (memory saver,
    colocated), sequence parallelism (TP > 1), twice the tensor parallelism (half the data parallelism)."""
    out: list[tuple[str, object]] = []
    tokens = c.micro_batch_tokens
    if tokens > c.max_seq_len:
        budget = _largest(c, "max_tokens_per_micro_batch", c.max_seq_len, tokens - 1, ROUND_TOKENS)
        if budget is not None:
            out.append(("max_tokens_per_micro_batch", budget))
        if c.max_tokens_per_micro_batch is None:
            rows = _largest(c, "micro_batch_size", 1, c.micro_batch_size - 1)
            if rows is not None:
                out.append(("micro_batch_size", rows))
    candidates = [("recompute_granularity", "full")] if c.recompute_granularity != "full" else []
    if mode_of(c.rollout_mode).shares_trainer_devices and not c.release_during_training:
        candidates.append(("release_during_training", True))
    if c.tp > 1 and not c.sequence_parallel:
        candidates.append(("sequence_parallel", True))
    if c.dp % 2 == 0:
        candidates.append(("tp", c.tp * 2))
    for field, value in candidates:
        try:
            changed = replace(c, **{field: value}, **({"dp": c.dp // 2} if field == "tp" else {}))
        except ConfigError:  # e.g. a TP that does not divide the heads
            continue
        if fits(changed):
            out.append((field, value))
    return out
