"""A decode step's work between two attention calls as one compiled call each (numba): the "compiled decode segments".

    attention_input(mode, h, norm_w, eps, xn, qkv, qkv_out, cos, sin, q, k, kv, layer, rows, slots)
    mlp_input(mode, attn, o, o_out, h, norm_w, eps, xn, gate_up, gate_up_out)
    mlp_output(mode, act, down, down_out, h, norm_w, eps, xn, qkv, qkv_out, cos, sin, q, k, kv, layer, rows, slots)
    final_output(mode, act, down, down_out, h, norm_w, eps, out)

A Llama-family decoder layer on a decode step's few rows (R <= packed_linear.MAX_KERNEL_ROWS) is, outside its
attention, a chain of small kernels: RMSNorm, the fused q/k/v product, RoPE, the cache write, then o_proj, the
residual add, RMSNorm, the fused gate/up product, silu(gate) * up, down_proj and the residual add. Called one by
one from Python, each cost a few microseconds of torch and numba dispatch around a few microseconds of work
(SmolLM2 at 4K: 12 ms a step around the kernels, 37 %; issue 50). Here each run of them between two points where
Python must run is one call: the attention (its paged kernel, its combine across ranks) and silu(gate) * up, which
stays torch's (its exp is not libm's: the same bits need the same function).

Every piece is the kernel the module path calls, with the same arguments and array types, so the same machine
code and the same bits: the packed products are packed_cpu_kernel's (float32 activations) or packed_int8_kernel's
(int8 activations; int16 values, Q6_K as q8_0, the float32 kernel as packed_linear.kernel_matmul does) serial entry
points, RMSNorm is rowwise_cpu_kernel.rms_norm; the residual adds are single float32 additions as torch's; RoPE is
rowwise_cpu_kernel.rope's arithmetic (two roundings, no fused multiply-add); the cache write rounds to the cache's
dtype as torch's .to() does (float16 and bfloat16 to nearest even).

Arguments (float32 C-contiguous arrays unless said):
    mode: () for float32 activations, (0,) for int8 (a tuple whose length the compiled code knows: only the chosen
        kernels are compiled, so nothing of the int8 kernel is compiled on a host without AVX-512 VNNI).
    a packed matrix (qkv, o, gate_up, down): (code, qs, d, m): code FORMAT_CODES[fmt] (Q6_K's int16 values:
        Q8_0_INT16), qs the values as uint8 bytes (N, K // 32, bytes), d, m (N, K // 32) (m: d again without offsets).
    h (R, D): the residual stream, updated in place; xn (R, D): scratch for the normed rows.
    norm_w (D,): an RMSNorm's weight; eps: its epsilon (a float).
    qkv_out (R, Nq + 2 Nkv), gate_up_out (R, 2 I), o_out / down_out (R, D): the products.
    cos, sin (R, head_dim): the rows' rope tables; q (R, Hq, head_dim), k (R, Hkv, head_dim): the rotated heads.
    kv: the paged cache's arena (layers, 2, blocks, block_size, Hkv, head_dim) as float32, or the bits of float16
        (int16) or bfloat16 (uint16); layer its layer; rows, slots int64 (n,): row rows[i]'s key and value go to
        flat slot slots[i] (block * block_size + offset).
    attn (R, Hq * head_dim): the attention's output; act (R, I): silu(gate) * up; out (R, D): the final norm's rows.

Importing this module compiles nothing; numba compiles each function on its first call and caches it beside this
file (cache=True). ops.warmup compiles them (warm_kernels(decode_segments=...)).

Example (the last layer's down_proj, residual add and final norm: the module path's bits)::

    >>> import numpy as np, torch
    >>> from treeattn.ops import decode_layer_cpu as seg
    >>> from treeattn.ops.packed_linear import packed_matmul
    >>> from treeattn.ops.rowwise import rms_norm
    >>> g = np.random.default_rng(0)
    >>> qs, d = g.integers(-127, 128, (32, 2, 32), dtype=np.int8), np.full((32, 2), 0.01, np.float32)    # q8_0 (32, 64)
    >>> act, h = g.standard_normal((1, 64), dtype=np.float32), g.standard_normal((1, 32), dtype=np.float32)
    >>> w, out = np.ones(32, np.float32), np.empty((1, 32), np.float32)
    >>> t = torch.from_numpy
    >>> expected = rms_norm(t(h) + packed_matmul(t(act), "q8_0", t(qs), t(d), None), t(w), 1e-6)
    >>> seg.final_output(seg.FLOAT32, act, (seg.Q8_0, qs.view(np.uint8), d, d), np.empty((1, 32), np.float32), h, w, 1e-6, out)
    >>> torch.equal(t(out), expected)
    True
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic, overload

from treeattn.ops import packed_cpu_kernel as f32
from treeattn.ops.numba_cache import lock_cache_saves
from treeattn.ops.rowwise_cpu_kernel import rms_norm

lock_cache_saves()  # before any cached kernel is compiled or saved: other processes may save beside this one

Q4_0, Q4_1, Q8_0, Q8_0_INT16 = 0, 1, 2, 3
FORMAT_CODES = {("q4_0", "uint8"): Q4_0, ("q4_1", "uint8"): Q4_1, ("q8_0", "int8"): Q8_0, ("q8_0", "int16"): Q8_0_INT16}
"""(format, values dtype) -> the code the compiled functions branch on."""
FLOAT32, INT8 = (), (0,)
"""The `mode` arguments: float32 activations (packed_cpu_kernel) or int8 (packed_int8_kernel)."""


def _product(mode, code, x, qs, d, m, out):  # pragma: no cover - replaced by its overload inside compiled code
    raise NotImplementedError


@overload(_product)
def _product_impl(mode, code, x, qs, d, m, out):
    """out = x @ W.T by the serial kernel packed_linear.kernel_matmul would call for this format and mode."""
    if len(mode) == 0:
        kernel = f32
    else:
        from treeattn.ops import packed_int8_kernel as kernel  # only where the int8 mode is compiled: AVX-512 VNNI

    def product(mode, code, x, qs, d, m, out):
        one = x.shape[0] * 0 + 1  # chunks: an int64, not a literal (the entry points' own signature)
        if code == Q4_0:
            kernel._q4_0_serial(x, qs, d, m, out, one)
        elif code == Q4_1:
            kernel._q4_1_serial(x, qs, d, m, out, one)
        elif code == Q8_0:
            kernel._q8_0_serial(x, qs.view(np.int8), d, m, out, one)
        else:  # int16 values (Q6_K): the float32 kernel in both modes, as kernel_matmul runs them
            f32._q8_0_serial(x, qs.view(np.int16), d, m, out, one)
    return product


def _stored(value, like):  # pragma: no cover - replaced by its overload inside compiled code
    raise NotImplementedError


@overload(_stored)
def _stored_impl(value, like):
    """A float32 value as the arena stores it (like: an element of the arena): itself, or float16 / bfloat16 bits
    rounded to nearest even, as torch's .to(dtype) rounds."""
    if like == types.float32:
        return lambda value, like: value
    if like == types.int16:
        return lambda value, like: _float16_bits(value)
    if like == types.uint16:
        return lambda value, like: _bfloat16_bits(value)
    return None


@intrinsic
def _bits(typingctx, value):
    """The bits of a float32 as an int64 (0 .. 2**32 - 1)."""
    if value != types.float32:
        return None

    def codegen(context, builder, signature, args):
        return builder.zext(builder.bitcast(args[0], ir.IntType(32)), ir.IntType(64))

    return types.int64(value), codegen


@njit(cache=True)
def _float16_bits(value):  # pragma: no cover - compiled
    """The IEEE float16 nearest to a float32 (ties to even), as int16 bits; NaN -> a quiet NaN of its sign."""
    u = _bits(value)
    sign = (u >> 16) & 0x8000
    a = u & 0x7FFFFFFF
    if a > 0x7F800000:
        h = sign | 0x7E00
    elif a >= 0x477FF000:  # 65520 and above round to infinity
        h = sign | 0x7C00
    elif a < 0x38800000:  # below 2**-14: a subnormal float16, m * 2**-24 (the scaling by 2**24 is exact)
        h = sign | np.int64(np.rint(np.abs(value) * np.float32(16777216.0)))
    else:
        h = sign | (((a + 0xFFF + ((a >> 13) & 1)) >> 13) - (112 << 10))
    return np.int16(np.uint16(h))


@njit(cache=True)
def _bfloat16_bits(value):  # pragma: no cover - compiled
    """The bfloat16 nearest to a float32 (ties to even), as uint16 bits; NaN -> 0x7FC0 (c10::BFloat16's)."""
    u = _bits(value)
    if (u & 0x7FFFFFFF) > 0x7F800000:
        return np.uint16(0x7FC0)
    return np.uint16((u + 0x7FFF + ((u >> 16) & 1)) >> 16)


@njit(cache=True, inline="always")
def _rope_heads(src, col0, cos, sin, dst):  # pragma: no cover - compiled
    """dst (R, H, D) = the heads at columns col0.. of src (R, *) rotated as rowwise_cpu_kernel.rope rotates them."""
    R, H, D = dst.shape
    half = D // 2
    for r in range(R):
        for hh in range(H):
            base = col0 + hh * D
            for j in range(half):
                dst[r, hh, j] = src[r, base + j] * cos[r, j] - src[r, base + j + half] * sin[r, j]
            for j in range(half, D):
                dst[r, hh, j] = src[r, base + j] * cos[r, j] + src[r, base + j - half] * sin[r, j]


@njit(cache=True, inline="always")
def _store(k, qkv_out, v0, kv, layer, rows, slots):  # pragma: no cover - compiled
    """The rotated keys k (R, Hkv, D) and the values (columns v0.. of qkv_out) of rows[i] into flat slot slots[i]."""
    H, D = k.shape[1], k.shape[2]
    bs = kv.shape[3]
    like = kv[0, 0, 0, 0, 0, 0]
    for i in range(rows.shape[0]):
        r, s = rows[i], slots[i]
        blk, off = s // bs, s % bs
        for hh in range(H):
            for j in range(D):
                kv[layer, 0, blk, off, hh, j] = _stored(k[r, hh, j], like)
                kv[layer, 1, blk, off, hh, j] = _stored(qkv_out[r, v0 + hh * D + j], like)


@njit(cache=True)
def attention_input(mode, h, norm_w, eps, xn, qkv, qkv_out, cos, sin, q, k, kv, layer, rows, slots):  # pragma: no cover
    """A layer's input RMSNorm, its fused q/k/v product, RoPE of q and k, and the keys and values into the cache."""
    rms_norm(h, norm_w, 0.0, eps, xn)
    _product(mode, qkv[0], xn, qkv[1], qkv[2], qkv[3], qkv_out)
    nq, nk = q.shape[1] * q.shape[2], k.shape[1] * k.shape[2]
    _rope_heads(qkv_out, 0, cos, sin, q)
    _rope_heads(qkv_out, nq, cos, sin, k)
    _store(k, qkv_out, nq + nk, kv, layer, rows, slots)


@njit(cache=True)
def mlp_input(mode, attn, o, o_out, h, norm_w, eps, xn, gate_up, gate_up_out):  # pragma: no cover - compiled
    """o_proj of the attention's output, the residual add, the post-attention RMSNorm and the fused gate/up product."""
    _product(mode, o[0], attn, o[1], o[2], o[3], o_out)
    _add(h, o_out)
    rms_norm(h, norm_w, 0.0, eps, xn)
    _product(mode, gate_up[0], xn, gate_up[1], gate_up[2], gate_up[3], gate_up_out)


@njit(cache=True, inline="always")
def _add(h, x):  # pragma: no cover - compiled
    """h += x, one float32 addition an element (torch's)."""
    for r in range(h.shape[0]):
        for j in range(h.shape[1]):
            h[r, j] = h[r, j] + x[r, j]


@njit(cache=True)
def mlp_output(mode, act, down, down_out, h, norm_w, eps, xn, qkv, qkv_out, cos, sin, q, k, kv, layer, rows,
               slots):  # pragma: no cover - compiled
    """down_proj, the residual add, then the next layer's attention_input."""
    _product(mode, down[0], act, down[1], down[2], down[3], down_out)
    _add(h, down_out)
    attention_input(mode, h, norm_w, eps, xn, qkv, qkv_out, cos, sin, q, k, kv, layer, rows, slots)


@njit(cache=True)
def final_output(mode, act, down, down_out, h, norm_w, eps, out):  # pragma: no cover - compiled
    """The last layer's down_proj and residual add, then the model's final RMSNorm into out."""
    _product(mode, down[0], act, down[1], down[2], down[3], down_out)
    _add(h, down_out)
    rms_norm(h, norm_w, 0.0, eps, out)


__all__ = ["FLOAT32", "FORMAT_CODES", "INT8", "Q4_0", "Q4_1", "Q8_0", "Q8_0_INT16", "attention_input", "final_output",
           "mlp_input", "mlp_output"]
