"""The verdicts of tools/gpu_check.py's rows: pure functions of CPU tensors and numbers, so that each row's ability
to FAIL is tested on a CPU with a planted defect (tests/tools/test_gpu_check_compare.py), not only its passing on a
GPU. Each returns (ok, verdict); ``None`` for ok is a skip (could not run here: never a pass).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass

import torch


@dataclass
class Row:
    check: str
    ok: bool
    result: str
    detail: str = ""
    skipped: bool = False  # could not run here (the result says why): neither a pass nor a failure


def size(nbytes: float) -> str:
    return f"{nbytes / 2**30:.2f} GiB" if abs(nbytes) >= 2**30 else f"{nbytes / 2**20:.1f} MiB"


# bf16 keeps 8 significant bits: machine epsilon 2^-7 (torch.finfo(torch.bfloat16).eps), unit roundoff u = 2^-8
EPS_BF16 = 2.0**-7
U_BF16 = EPS_BF16 / 2
# the train row's floor: 6 N flops per token against the card's dense bf16 peak (a lower bound on MFU, attention not
# counted). A 0.5B model at 2048 tokens on the local spec sits well above it on a Hopper card; below it the run fell
# back to fp32 math, to the CPU, or to a host sync per op.
MFU_FLOOR = 0.10
# the server row's probe: an fp32 server against transformers in fp32 on a tiny model, log-probs of size ~5: a few
# fp32 ulps (~1e-6) apart on one device, up to ~1e-4 across kernels (tests/sglang_real uses 1e-4 on the CPU build);
# another model's weights move them by ~1 (the row checks that too)
PROBE_TOLERANCE = 1e-3


def logprob_bounds(logit_scale: torch.Tensor, n_layers: int) -> tuple[torch.Tensor, float]:
    """(per-token bound, bound on the mean difference) for log-probs computed in bf16 against an fp32/fp64 reference
    with the same (bf16-representable) weights. ``logit_scale``: max_v |z_v| of the reference logits per position.

    Each of the ``n_layers`` layers' outputs and the output layer's logits are rounded to bf16, each moving a logit
    by at most u |z| relative to the residual it lands in; a log-prob (z_t - logsumexp z) carries two logits' errors:
    2 u (1 + |z|max) (n_layers + 1) per token (the 1: logits near 0 still round the hidden state they come from).
    Round-to-nearest-even is unbiased: over n tokens the mean difference stays within u mean(1 + |z|max); a
    systematic shift above that (a wrong scale, temperature, a dropped term) is a defect, not rounding."""
    scale = 1.0 + logit_scale.double()
    return 2 * U_BF16 * scale * (n_layers + 1), float(U_BF16 * scale.mean())


def compare_logprobs(ours: torch.Tensor, reference: torch.Tensor, logit_scale: torch.Tensor,
                     n_layers: int) -> tuple[bool, str]:
    """``ours`` (bf16 pipeline) against ``reference`` per token, in fp64: every token within its bound
    (``logprob_bounds``) and the mean difference within its own."""
    if ours.shape != reference.shape:
        return False, f"shapes differ: {tuple(ours.shape)} vs {tuple(reference.shape)}"
    d = ours.double() - reference.double()
    per_token, mean_bound = logprob_bounds(logit_scale.reshape(d.shape), n_layers)
    worst = float((d.abs() / per_token).max())
    bias = float(d.mean())
    ok = bool(torch.isfinite(d).all()) and worst <= 1.0 and abs(bias) <= mean_bound
    verdict = (f"max |d| {float(d.abs().max()):.2e} ({worst:.2f} of its bound), mean d {bias:+.2e} (bound "
               f"{mean_bound:.1e}) over {d.numel()} tokens")
    return ok, verdict


def compare_bitwise(want: Mapping[str, torch.Tensor], got: Mapping[str, torch.Tensor]) -> tuple[bool, str]:
    """Every tensor of ``want`` in ``got`` with the same dtype, shape and bits; no tensor more or fewer."""
    missing, extra = sorted(set(want) - set(got)), sorted(set(got) - set(want))
    differ = [n for n in want if n in got and not (want[n].dtype == got[n].dtype and want[n].shape == got[n].shape
                                                   and torch.equal(want[n].cpu(), got[n].cpu()))]
    if missing or extra or differ:
        return False, (f"missing {missing[:3]}" if missing else "") + (f" extra {extra[:3]}" if extra else "") + (
            f" differ ({len(differ)}): {differ[:3]}" if differ else "")
    return True, f"{len(want)} tensors bitwise"


def compare_peaks(planned: Mapping[str, int], measured: Mapping[str, int]) -> tuple[bool, str]:
    """Each measured term (activations, logits, ...) at or below what the plan counted for it."""
    over = [t for t in planned if measured.get(t) is not None and measured[t] > planned[t]]
    said = ", ".join(f"{t} {measured[t] / 2**20:.0f}/{planned[t] / 2**20:.0f} MiB" for t in planned
                     if measured.get(t) is not None)
    if over:
        return False, "ABOVE the plan: " + ", ".join(over) + f" (measured/planned: {said})"
    return True, f"within the plan (measured/planned: {said})"


def mfu_verdict(mfu: float, floor: float = MFU_FLOOR) -> tuple[bool, str]:
    if not math.isfinite(mfu) or mfu < floor:
        return False, f"MFU {100 * mfu:.1f}% below the floor {100 * floor:.0f}%"
    return True, f"MFU {100 * mfu:.1f}% (floor {100 * floor:.0f}%)"


def pytest_verdict(returncode: int, output: str, expected: int) -> tuple[bool | None, str]:
    """A pytest run's verdict: a pass only when ``expected`` tests passed and none failed; all skipped is a skip."""
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|error|errors)", output)}
    passed, failed = counts.get("passed", 0), counts.get("failed", 0) + counts.get("error", 0) + counts.get("errors", 0)
    said = ", ".join(f"{n} {k}" for k, n in counts.items()) or f"exit {returncode}, no summary"
    if failed:
        return False, said
    if passed == 0 and counts.get("skipped"):
        return None, said
    return returncode == 0 and passed >= expected, said


def push_verdict(before: float, after: float, tolerance: float) -> tuple[bool, str]:
    """A weight push judged by the probe of the pushed weights' log-probs (mean |served - reference|): above the
    tolerance before the push (else the probe cannot tell the weights apart and proves nothing) and within it after."""
    said = f"probe {before:.2e} before the push, {after:.2e} after (tolerance {tolerance:g})"
    if not before > tolerance:
        return False, said + ": the probe cannot tell the old weights from the new"
    if not after <= tolerance:  # NaN fails too
        return False, said + ": the server does not serve the pushed weights"
    return True, said
