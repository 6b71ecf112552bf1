"""Float tolerances that hold on every CPU (Intel with AVX-512/AMX, AMD with AVX2 only), derived from the dtype and
the reduction size, never from what one machine happened to measure.

Two computations of the same quantity that differ only in summation order (another CPU's kernels, another
micro-batch split, another tensor-parallel layout) each carry a relative rounding error of at most
γ_n = n·u / (1 − n·u) ≈ n·u for a sum of n terms, u = eps / 2 (Higham, *Accuracy and Stability of Numerical
Algorithms*, 2nd ed., Lemma 3.1 and §3.1). Through ``depth`` chained reductions the first-order errors add, and both
sides err, so the norm-wise relative difference is at most depth · n · eps.

This is a worst-case bound. In fp32 it is loose enough to hide a small defect (n = 10⁴ gives ~1e-3), so tests that
must see small defects (a wrong loss scale, a missing all-reduce) run in fp64, where the same bound is ~1e-11 and a
real defect sits many orders of magnitude above it.
"""

from __future__ import annotations

import torch


def reorder_rtol(dtype: torch.dtype, n_terms: int, depth: int = 1) -> float:
    """Bound on |a − b| / |b| (norm-wise) for two results that differ only in the order of their reductions."""
    return depth * max(n_terms, 1) * torch.finfo(dtype).eps
