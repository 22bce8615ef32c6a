"""The CUDA kernel of a linear layer whose weight is kept in ggml's block formats (treeattn.ops.packed_linear), in Triton.

    out = packed_matmul(x, "q4_1", qs, d, m)      # x (M, K) on CUDA, M <= packed_linear.MAX_KERNEL_ROWS -> float32 (M, N)

The GPU counterpart of treeattn.ops.packed_cpu_kernel, for decode steps: a few rows of activations
times every weight once, a GEMV whose time is the time to stream the weight, so the weight is read in
its blocks (4.75 to 9 bits a weight for q4_0 / q4_1 / q8_0) and never written out in float. Each
program holds one row of x and BLOCK_N rows of W; it walks K in tiles of BLOCK_K weights, loads a
tile's bytes and scales, rebuilds each weight in registers as ggml and gguf.quants do (float32:
q4_0 d * (q - 8), q4_1 d * q + m, q8_0 d * q; d * q is exact in float32, so a fused multiply-add for
q4_1 rounds once, as the separate operations do), and accumulates x * w in float32. The weights are
exactly the file's float32 dequantization; only the order of the float32 sums differs from x @ W.

The layouts are packed_linear.unpack_blocks' (and its K-quant conversions'):
    q4_0, q4_1: qs uint8 (N, K // 32, 16), byte j = weight j (low nibble) | weight j + 16 (high nibble)
    q8_0:       qs int8 (N, K // 32, 32), or int16 for Q6_K's held values (q6_k_as_q8_0)
    d, m:       float32 (N, K // 32) (m: q4_1 only)

Triton is an optional dependency: import this module only where triton is installed (packed_linear
imports it lazily, for CUDA tensors). With TRITON_INTERPRET=1 set before the first import, the kernel
runs on CPU tensors through Triton's interpreter (the tests do so on a machine without a GPU).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

BLOCK = 32
BLOCK_N = 64  # weight rows (output columns) per program
BLOCK_K = 128  # weights per row per tile: four ggml blocks
_FORMAT_CODES = {"q4_0": 0, "q4_1": 1, "q8_0": 2}


@triton.jit
def _packed_matmul_kernel(x_ptr, qs_ptr, d_ptr, m_ptr, out_ptr, N, K, stride_xm, stride_om,
                          FMT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """out[i, n] = sum_k x[i, k] * w[n, k] for row i = program_id(0), rows n of program_id(1)'s BLOCK_N."""
    row = tl.program_id(0)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < N
    rows = rn.to(tl.int64)  # row offsets in int64: N * K passes 2**31 for the largest output projections
    blocks = K // 32
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        k_ok = rk < K
        x = tl.load(x_ptr + row * stride_xm + rk, mask=k_ok, other=0.0).to(tl.float32)
        blk = rk // 32
        pos = rk % 32
        ok = n_ok[:, None] & k_ok[None, :]
        d = tl.load(d_ptr + rows[:, None] * blocks + blk[None, :], mask=ok, other=0.0)
        if FMT == 2:  # q8_0: a block's 32 values in order
            q = tl.load(qs_ptr + rows[:, None] * K + rk[None, :], mask=ok, other=0).to(tl.float32)
            w = d * q
        else:  # q4_0, q4_1: weight pos of a block is byte pos % 16's low (pos < 16) or high nibble
            byte = tl.load(qs_ptr + rows[:, None] * (blocks * 16) + (blk * 16 + pos % 16)[None, :], mask=ok, other=0)
            q = tl.where((pos < 16)[None, :], byte & 15, byte >> 4).to(tl.float32)
            if FMT == 0:
                w = d * (q - 8.0)
            else:
                m = tl.load(m_ptr + rows[:, None] * blocks + blk[None, :], mask=ok, other=0.0)
                w = d * q + m
        acc += tl.sum(w * x[None, :], axis=1)
    tl.store(out_ptr + row * stride_om + rn, acc, mask=n_ok)


_INTERPRETED = isinstance(_packed_matmul_kernel, InterpretedFunction)


def packed_matmul(x: torch.Tensor, fmt: str, qs: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None) -> torch.Tensor:
    """x @ W.T for a packed W (packed_linear.unpack_blocks' qs, d, m) on x's device.

    Args:
        x: (M, K) float tensor (any float dtype; taken in float32), on CUDA, or on the CPU under
            TRITON_INTERPRET=1.
        fmt: "q4_0", "q4_1" or "q8_0"; qs, d, m: the packed weight W (N, K), on x's device.

    Returns:
        float32 (M, N).

    Example (on a GPU; the tests run it through the interpreter)::

        >>> import gguf.quants, numpy as np, torch
        >>> from treeattn.ops.packed_linear import dequantize_packed, unpack_blocks
        >>> w = np.random.default_rng(0).standard_normal((64, 64)).astype(np.float32)
        >>> raw = gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q4_1)       # 64 rows of two q4_1 blocks, as a file holds them
        >>> qs, d, m = (t.cuda() for t in unpack_blocks("q4_1", raw))
        >>> x = torch.randn(1, 64, device="cuda")
        >>> torch.allclose(packed_matmul(x, "q4_1", qs, d, m), x @ dequantize_packed("q4_1", qs, d, m).T, atol=1e-4)
        True
    """
    if fmt not in _FORMAT_CODES:
        raise ValueError(f"fmt must be one of {tuple(_FORMAT_CODES)}, got {fmt!r}")
    N, K = qs.shape[0], qs.shape[1] * BLOCK
    if x.dim() != 2 or x.shape[1] != K:
        raise ValueError(f"x must be (M, {K}) (the packed weight's columns), got shape {tuple(x.shape)}")
    x = x.contiguous()
    out = torch.empty((x.shape[0], N), dtype=torch.float32, device=x.device)
    grid = (x.shape[0], triton.cdiv(N, BLOCK_N))
    _packed_matmul_kernel[grid](x, qs.contiguous(), d.contiguous(), d if m is None else m.contiguous(), out, N, K,
                                x.stride(0), out.stride(0), FMT=_FORMAT_CODES[fmt], BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K)
    return out


__all__ = ["packed_matmul"]
