"""The plan's margin for the terms it counts but no GPU has measured, and the file that shrinks it.

The activation and logits terms of the memory plan (``memory_plan.layer_activation_bytes``, ``_logits_bytes``) are
counts of the tensors autograd keeps, checked against a measured peak on the CPU path (local spec, within 0.5 %,
tests/memory/test_cpu_peak.py) but never against ``torch.cuda.max_memory_allocated`` on transformer-engine's
spec, whose fused kernels save different tensors. An undercount of ~10 % in these terms kills a run at its first
full-length micro-batch, hours in; so until a GPU has measured them the plan adds ``UNMEASURED_MARGIN`` of both
terms as a row of its own and no budget is accepted without it.

``tools/gpu_check.py`` measures both terms on the GPU it runs on (per layer spec: "local" everywhere,
"transformer_engine" where TE is installed) and writes ``{"terms": [{"transformer_impl", "term", "planned_bytes",
"measured_bytes"}, ...]}`` (``write``). ``--measured-peaks PATH`` reads it (``load``): a measured term's margin is
then how far the measurement exceeded the count (0 when it did not) plus ``MEASURED_MARGIN`` for what one measured
shape does not say of another (the caching allocator's rounding, a kernel choice that depends on the shape).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from megamu.errors import ConfigError

UNMEASURED_MARGIN = 0.15  # > the ~10 % undercount that issue 50 shows would end a 7B run at its first long batch
MEASURED_MARGIN = 0.05
TERMS = ("activations", "logits")
IMPLS = ("transformer_engine", "local")


@dataclass(frozen=True)
class MeasuredTerm:
    transformer_impl: str
    term: str
    planned_bytes: int
    measured_bytes: int

    @property
    def ratio(self) -> float:
        return self.measured_bytes / self.planned_bytes


@dataclass(frozen=True)
class MeasuredPeaks:
    """The terms one gpu_check run measured; ``source`` names the file (for the plan's row and errors)."""

    terms: tuple[MeasuredTerm, ...]
    source: str = ""

    def ratio(self, transformer_impl: str, term: str) -> float | None:
        """measured / planned for this spec and term (the largest if measured more than once), None if not measured."""
        ratios = [t.ratio for t in self.terms if t.transformer_impl == transformer_impl and t.term == term]
        return max(ratios) if ratios else None

    def margin(self, transformer_impl: str, term: str) -> float:
        ratio = self.ratio(transformer_impl, term)
        return UNMEASURED_MARGIN if ratio is None else max(ratio - 1.0, 0.0) + MEASURED_MARGIN


def margin_fraction(measured: MeasuredPeaks | None, transformer_impl: str, term: str) -> float:
    """The fraction of ``term`` the plan adds for ``transformer_impl``: ``UNMEASURED_MARGIN`` unless measured."""
    return UNMEASURED_MARGIN if measured is None else measured.margin(transformer_impl, term)


def margin(measured: MeasuredPeaks | None, transformer_impl: str, activations: int, logits: int) -> tuple[str, int]:
    """(the plan's row label, bytes): room for the activation and logits counts being short, a stated fraction of
    each, as measured or ``UNMEASURED_MARGIN``."""
    said = [(margin_fraction(measured, transformer_impl, term), size,
             measured is not None and measured.ratio(transformer_impl, term) is not None)
            for term, size in (("activations", activations), ("logits", logits))]
    status = {(True, True): "as measured", (False, False): "not measured on a GPU"}.get(
        (said[0][2], said[1][2]), "activations " + ("measured" if said[0][2] else "not measured"))
    spec = {"transformer_engine": "TE", "local": "local"}[transformer_impl]
    label = f"margin: {said[0][0]:.0%} of activations, {said[1][0]:.0%} of logits ({spec} spec, {status})"
    return label, int(sum(f * size for f, size, _ in said))


def load(path: str | Path, field: str = "measured_peaks") -> MeasuredPeaks:
    """The file ``write`` wrote; a ConfigError on ``field`` naming the file and the entry that is wrong."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(field, f"{path}: cannot read a measured-peaks file ({e})") from None
    entries = data.get("terms") if isinstance(data, dict) else None
    if not isinstance(entries, list) or not entries:
        raise ConfigError(field, f"{path}: no 'terms' list (tools/gpu_check.py --measured-peaks writes one)")
    terms = []
    for i, entry in enumerate(entries):
        where = f"{path}: terms[{i}]"
        if not isinstance(entry, dict):
            raise ConfigError(field, f"{where}: expected an object, got {entry!r}")
        impl, term = entry.get("transformer_impl"), entry.get("term")
        if impl not in IMPLS or term not in TERMS:
            raise ConfigError(field, f"{where}: transformer_impl {impl!r} / term {term!r}: expected one of {IMPLS} / "
                                     f"{TERMS}")
        sizes = [entry.get("planned_bytes"), entry.get("measured_bytes")]
        if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in sizes):
            raise ConfigError(field, f"{where}: planned_bytes and measured_bytes must be positive integers, got "
                                     f"{sizes}")
        terms.append(MeasuredTerm(impl, term, *sizes))
    return MeasuredPeaks(tuple(terms), str(path))


def write(path: str | Path, terms: list[MeasuredTerm], device: str) -> None:
    """The file ``load`` reads: what gpu_check measured on ``device`` (a name, for the reader)."""
    rows = [{"transformer_impl": t.transformer_impl, "term": t.term, "planned_bytes": int(t.planned_bytes),
             "measured_bytes": int(t.measured_bytes)} for t in terms]
    Path(path).write_text(json.dumps({"device": device, "terms": rows}, indent=1) + "\n")
