"""What the packed-weight tests share: random weights of varied scale and the float32 dot-product bound.

A float32 dot product of length K (any summation order) is within gamma_K * sum_k |x_k| |w_k| of the
exact one, gamma_K = K u / (1 - K u), u = 2**-24, when the products' factors are exact float32 values
(tests/test_packed_weights.py, tests/test_packed_triton.py).
"""

from __future__ import annotations

import numpy as np
import torch

U = 2.0 ** -24


def gamma(n: int) -> float:
    return n * U / (1 - n * U)


def weights(rows: int, cols: int, seed: int) -> np.ndarray:
    """Rows of varied scale: ordinary, large, tiny, one constant row, one zero row (scale 0), one with an offset."""
    g = np.random.default_rng(seed)
    w = g.standard_normal((rows, cols)).astype(np.float32)
    w[1] *= 1e3
    w[2] *= 1e-4
    w[3] = 0.5
    w[4] = 0.0
    w[5] += 7.0
    return w


def assert_within_float32_bound(y: torch.Tensor, x: torch.Tensor, w: np.ndarray) -> None:
    """y (M, N) = x (M, K) @ w.T accumulated in float32 (on any device): within gamma_K * |x| @ |w|.T of the float64 product."""
    w64 = torch.from_numpy(w).double()
    x64 = x.cpu().double()
    bound = gamma(w.shape[1]) * (x64.abs() @ w64.abs().T)
    assert y.shape == (x.shape[0], w.shape[0])
    assert bool(((y.cpu().double() - x64 @ w64.T).abs() <= bound).all())
