"""What to change when a memory plan does not fit: each setting that, changed alone, makes every phase fit
(``fixes``), then the layouts that fit, alone or with the largest token budget that fits at them (``fix_sets``).

Pure arithmetic on ``MemoryPlanConfig`` (replanned with ``plan_memory``); the caller names the flags (fields are
the config's, e.g. ``max_tokens_per_micro_batch``, ``release_during_training``)."""

from __future__ import annotations

from dataclasses import replace

from megamu.errors import ConfigError
from megamu.memory.memory_plan import MemoryPlanConfig, plan_memory

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
    if c.weight_push == "memory":  # a colocated refresh from an export on disk gathers no full copy on the GPU
        candidates.append(("weight_push", "disk"))
    if not c.offload_train:
        candidates.append(("offload_train", True))
    if c.mode.shares_trainer_devices and not c.release_during_training:
        candidates.append(("release_during_training", True))
    if c.tp > 1 and not c.sequence_parallel:
        candidates.append(("sequence_parallel", True))
    if c.dp % 2 == 0 and not c.model.num_experts:  # MoE at TP > 1 needs SP: fix_sets names TP with it
        candidates.append(("tp", c.tp * 2))
    for field, value in candidates:
        try:
            changed = replace(c, **{field: value}, **({"dp": c.dp // 2} if field == "tp" else {}))
        except ConfigError:  # e.g. a TP that does not divide the heads
            continue
        if fits(changed):
            out.append((field, value))
    return out


MAX_SUGGESTIONS = 6


def _layouts(c: MemoryPlanConfig) -> list[list[tuple[str, object]]]:
    """Larger model-parallel layouts on the same GPUs, smallest first: TP x 2^k within a node (with sequence
    parallelism: megatron splits the norms' activations over TP with it, and runs MoE at TP > 1 only with it), and for
    a mixture of experts EP x 2^k (fewer experts per GPU, their state over fewer expert-DP ranks) while ETP x EP fits
    the world: the expert groups are formed over the whole world apart from TP (megatron-core's parallel folding), so
    with experts at ETP 1 EP may exceed DP."""
    out = []
    tp = c.tp * 2
    while tp <= c.ranks_per_node and c.dp * c.tp % tp == 0:
        out.append([("tp", tp), ("sequence_parallel", True)])
        tp *= 2
    ep = c.ep * 2
    while c.model.num_experts and c.expert_tp * ep <= c.tp * c.dp and c.model.num_experts % ep == 0:
        out.append([("ep", ep)])
        ep *= 2
    return out


def _apply(c: MemoryPlanConfig, changes: list[tuple[str, object]]) -> MemoryPlanConfig | None:
    fields = dict(changes)
    if "tp" in fields:  # the same GPUs: what TP takes, DP gives
        fields["dp"] = c.dp * c.tp // fields["tp"]
    try:
        return replace(c, **fields)
    except ConfigError:  # e.g. a TP that does not divide the heads, an EP that does not divide the experts
        return None


def fix_sets(c: MemoryPlanConfig) -> list[list[tuple[str, object]]]:
    """Changes that make ``c`` fit, each a list of (field, value) to apply together: every single change of
    ``fixes``, then each larger layout (``_layouts``) that fits alone, or else with the largest token budget that
    fits at it (a multiple of ``ROUND_TOKENS``, at least one row). The smallest layout of each kind that fits is
    named, not the larger ones after it; at most ``MAX_SUGGESTIONS`` in all."""
    out = [[fix] for fix in fixes(c)]
    named_kinds: set[str] = set()
    for layout in _layouts(c):
        kind = layout[0][0]
        changed = _apply(c, layout)
        if kind in named_kinds or changed is None or [layout[0]] in out:  # TP x 2 alone already fits
            continue
        if fits(changed):
            out.append(layout)
            named_kinds.add(kind)
            continue
        if changed.micro_batch_tokens > changed.max_seq_len:
            budget = _largest(changed, "max_tokens_per_micro_batch", changed.max_seq_len,
                              changed.micro_batch_tokens - 1, ROUND_TOKENS)
            if budget is not None:
                out.append(layout + [("max_tokens_per_micro_batch", budget)])
                named_kinds.add(kind)
    return out[:MAX_SUGGESTIONS]
