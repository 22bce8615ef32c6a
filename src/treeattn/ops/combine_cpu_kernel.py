"""The CPU kernels of onepass's combine (treeattn.parallel.tree_decode.onepass_combine), compiled by numba.

onepass merges the ranks' attention states with one all-reduce of a float64 buffer

    [out * exp(lse) (B, Sq, Hq, Dv), exp(lse) (B, Hq, Sq), rows outside the window (1)]

and divides after it. In torch that is some thirty small operations around the collective; a
decode step runs it once per layer, and on the CPU their fixed cost (about 300 us a call on this
project's 2-core machine, docs/benchmarks.md) was most of the combine. Here the packing is one
call and the check and division one more, with the same operations in the same order: float64 exp
of the float32 (or float64) lse, float64 products, the division by the reduced sum (1 where it is 0)
and its log, cast once to the states' dtype. Not the same bits on every host: exp and log here are
libm's, torch's are its vectorized ones (SLEEF) or libm's depending on the CPU capability it picks,
each within 1 ulp, so the two results can differ by a few float64 ulps (tests/test_onepass.py
derives the bound) and a float32 result by one float32 rounding. The fallbacks are torch's code on
both paths.

Importing this module compiles nothing: numba compiles each kernel on its first call and caches
the machine code beside this file (cache=True).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from treeattn.ops.numba_cache import lock_cache_saves

lock_cache_saves()  # before any cached kernel is compiled or saved: other processes may save beside this one


@njit(cache=True)
def onepass_pack(out, lse, window, buffer):  # pragma: no cover - compiled
    """Fill buffer (float64, B*Sq*Hq*Dv + B*Hq*Sq + 1) from out (B, Sq, Hq, Dv) and lse (B, Hq, Sq),
    both float32 or both float64: [out * exp(lse), exp(lse), the number of finite lse with |lse| > window].
    A row with lse = -inf (no key here) packs zeros."""
    B, Sq, Hq, Dv = out.shape
    n_out = B * Sq * Hq * Dv
    outside = 0
    for b in range(B):
        for h in range(Hq):
            for s in range(Sq):
                value = np.float64(lse[b, h, s])
                if np.isfinite(value) and abs(value) > window:
                    outside += 1
                weight = np.exp(value)
                buffer[n_out + (b * Hq + h) * Sq + s] = weight
                base = ((b * Sq + s) * Hq + h) * Dv
                for d in range(Dv):
                    buffer[base + d] = np.float64(out[b, s, h, d]) * weight
    buffer[n_out + B * Hq * Sq] = outside


@njit(cache=True)
def onepass_unpack(buffer, out, lse):  # pragma: no cover - compiled
    """From the reduced buffer (onepass_pack's layout, summed over the ranks) write the merged out
    (B, Sq, Hq, Dv) and lse (B, Hq, Sq) (float32 or float64) and return True; return False, writing
    nothing, when the one pass was not exact (a row outside the window on some rank, or a numerator
    that is not finite): the caller then falls back to the two-collective combine."""
    B, Sq, Hq, Dv = out.shape
    n_out = B * Sq * Hq * Dv
    if buffer[n_out + B * Hq * Sq] != 0:
        return False
    for i in range(n_out):
        if not np.isfinite(buffer[i]):
            return False
    for b in range(B):
        for h in range(Hq):
            for s in range(Sq):
                total = buffer[n_out + (b * Hq + h) * Sq + s]
                safe = total if total > 0 else 1.0
                lse[b, h, s] = np.log(total)  # log(0) = -inf: the row saw no key anywhere
                base = ((b * Sq + s) * Hq + h) * Dv
                for d in range(Dv):
                    out[b, s, h, d] = buffer[base + d] / safe
    return True
