"""The CPU kernels of a decoder layer's row-wise ops (treeattn.ops.rowwise), compiled by numba.

A decode step runs RMSNorm twice and RoPE twice (queries, keys) in every layer on a row or a few
rows of a few hundred values: each costs a handful of torch calls whose fixed cost (about 5-10 us
each on this project's 2-core machine) was about a seventh of a SmolLM2 layer's time outside
attention (docs/benchmarks.md). Here each is one call.

    rms_norm(x, weight, offset, eps, out)   x, out (R, D) float32, weight (D,) float32, offset a float:
        out = (weight + offset) * (x * 1 / sqrt(mean(x**2) + eps)), the mean in float32 (lanes summed
        in another order than torch's: the one difference, within float32 rounding); offset 0 is
        Llama's norm (the weight itself, not weight + 0), 1 Gemma's (1 + weight, rounded to float32)
    rope(x, cos, sin, out)          x, out (R, H, D) float32, cos, sin (R, D) float32, the
        rotate-half layout: out = x * cos + rotate_half(x) * sin, the same two roundings as torch's
        (no fused multiply-add here: bit for bit torch's result)
    rope_pair(q, k, cos, sin, out_q, out_k)    rope of q (R, Hq, D) and of k (R, Hkv, D) in one call, each as rope

Importing this module compiles nothing: numba compiles each kernel on its first call and caches
the machine code beside this file (cache=True).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from treeattn.ops.numba_cache import lock_cache_saves

lock_cache_saves()  # before any cached kernel is compiled or saved: other processes may save beside this one


@njit(cache=True, fastmath={"reassoc", "contract"})
def rms_norm(x, weight, offset, eps, out):  # pragma: no cover - compiled
    """RMSNorm of every row of x (R, D) float32 into out (see the module doc)."""
    R, D = x.shape
    shift = np.float32(offset)
    for r in range(R):
        total = np.float32(0.0)
        for j in range(D):
            total += x[r, j] * x[r, j]
        inverse = np.float32(1.0) / np.sqrt(total / np.float32(D) + np.float32(eps))
        if offset == 0:
            for j in range(D):
                out[r, j] = weight[j] * (x[r, j] * inverse)
        else:
            for j in range(D):
                out[r, j] = (weight[j] + shift) * (x[r, j] * inverse)


@njit(cache=True)
def rope(x, cos, sin, out):  # pragma: no cover - compiled
    """Rotate every head of x (R, H, D) float32 by its row's cos, sin (R, D) into out (see the module doc)."""
    R, H, D = x.shape
    half = D // 2
    for r in range(R):
        for h in range(H):
            for j in range(half):
                out[r, h, j] = x[r, h, j] * cos[r, j] - x[r, h, j + half] * sin[r, j]
            for j in range(half, D):
                out[r, h, j] = x[r, h, j] * cos[r, j] + x[r, h, j - half] * sin[r, j]


@njit(cache=True)
def rope_pair(q, k, cos, sin, out_q, out_k):  # pragma: no cover - compiled
    """rope(q, cos, sin, out_q) and rope(k, cos, sin, out_k) in one call (a layer's queries and keys)."""
    rope(q, cos, sin, out_q)
    rope(k, cos, sin, out_k)
