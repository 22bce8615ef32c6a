"""A decode step's work between two attention calls as one compiled call each (numba): the "compiled decode segments".

    attention_input(mode, h, norm_w, eps, xn, qkv, qkv_out, cos, sin, q, k, kv, layer, rows, slots)
    mlp_input(mode, attn, o, o_out, h, norm_w, eps, xn, gate_up, gate_up_out)
    mlp_output(mode, act, down, down_out, h, norm_w, eps, xn, qkv, qkv_out, cos, sin, q, k, kv, layer, rows, slots)
    final_output(mode, act, down, down_out, h, norm_w, eps, out)
    gemma_attention_input / gemma_mlp_input / gemma_mlp_output / gemma_final_output: Gemma 3's (below)
    product, norm_gate_up, residual_attention_input, residual_final_norm: the Helix layout's (--tp), mlp_input,
        mlp_output and final_output cut where o_proj's and down_proj's partial sums are all-reduced (below)

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

Gemma 3 (models.gemma3) differs in its norms and heads, and its segments say so in their names and arguments: every
RMSNorm scales by 1 + weight (rowwise_cpu_kernel.rms_norm's offset 1, as Gemma3RMSNorm calls it); a layer has four
(input; post-attention on o_proj's output before the residual add; pre-feedforward; post-feedforward on down_proj's
output before the residual add), passed as `norms`, the tuple (input, post_attention, pre_feedforward,
post_feedforward, q_norm, k_norm) of weights with one eps; q_norm and k_norm normalize every query and key head
(head_dim) before RoPE, each head copied into C-contiguous rows first as numpy_rows gives the module path's call
(`heads`: those rows and the normed heads, scratch), then the queries are multiplied by `factor` (the module's
query_factor; 1.0 for none) as torch multiplies a float32 tensor by a Python float (the scalar rounded to float32);
`post` (R, D) takes the post norms' rows. GELU-tanh(gate) * up stays torch's between the calls, as silu * up does.
A window layer's cache is not the paged arena: its segment gets no rows (rows and slots empty) and the caller writes
and attends its ring (engine.worker.compiled_decode).

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
from treeattn.ops.paged_cpu_kernel import _wide
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


@njit(cache=True)
def window_store(k, qkv_out, v0, row, ring_k, ring_v, at, like):  # pragma: no cover - compiled
    """Step row `row`'s rotated keys k[row] (Hkv, D) and its values (columns v0.. of qkv_out) into row `at` of a window
    layer's ring, ring_k and ring_v (size, Hkv, D) float32, as WindowKVCache's write stores them (held_dtype float32: each
    value rounded through the cache dtype, whose bits' type `like` is, float32 itself: the arena's bits widened back by
    the paged kernel's own exact _wide, as torch's .to(dtype).to(torch.float32))."""
    for hh in range(k.shape[1]):
        for j in range(k.shape[2]):
            ring_k[at, hh, j] = _wide(_stored(k[row, hh, j], like))
            ring_v[at, hh, j] = _wide(_stored(qkv_out[row, v0 + hh * k.shape[2] + j], like))


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


@njit(cache=True)
def product(mode, x, matrix, out):  # pragma: no cover - compiled
    """out = x @ W.T for a packed matrix (code, qs, d, m): the Helix layout's o_proj and down_proj shares, whose
    partial sums the caller all-reduces between this and the segment after it."""
    _product(mode, matrix[0], x, matrix[1], matrix[2], matrix[3], out)


@njit(cache=True)
def norm_gate_up(mode, o_out, h, norm_w, eps, xn, gate_up, gate_up_out):  # pragma: no cover - compiled
    """mlp_input after its o_proj (summed across the tensor-parallel ranks): the residual add, the post-attention
    RMSNorm and the fused gate/up product."""
    _add(h, o_out)
    rms_norm(h, norm_w, 0.0, eps, xn)
    _product(mode, gate_up[0], xn, gate_up[1], gate_up[2], gate_up[3], gate_up_out)


@njit(cache=True)
def residual_attention_input(mode, down_out, h, norm_w, eps, xn, qkv, qkv_out, cos, sin, q, k, kv, layer, rows,
                             slots):  # pragma: no cover - compiled
    """mlp_output after its down_proj (summed across the ranks): the residual add, then the next layer's
    attention_input."""
    _add(h, down_out)
    attention_input(mode, h, norm_w, eps, xn, qkv, qkv_out, cos, sin, q, k, kv, layer, rows, slots)


@njit(cache=True)
def residual_final_norm(down_out, h, norm_w, eps, out):  # pragma: no cover - compiled
    """final_output after its down_proj (summed across the ranks): the residual add and the model's final RMSNorm."""
    _add(h, down_out)
    rms_norm(h, norm_w, 0.0, eps, out)


@njit(cache=True, inline="always")
def _norm_heads(src, col0, weight, eps, rows, dst):  # pragma: no cover - compiled
    """Gemma's per-head RMSNorm (1 + weight) of the heads at columns col0.. of src (R, *): each head copied into
    rows (R * H, D) (C-contiguous, as numpy_rows gives the module path's q_norm / k_norm its rows), then normed into
    dst (R, H * D), viewed as (R * H, D): the same kernel call on the same array types as the module path's."""
    H, D = dst.shape[1] // weight.shape[0], weight.shape[0]
    for r in range(src.shape[0]):
        for hh in range(H):
            for j in range(D):
                rows[r * H + hh, j] = src[r, col0 + hh * D + j]
    rms_norm(rows, weight, 1.0, eps, dst.reshape(rows.shape))


@njit(cache=True)
def gemma_attention_input(mode, h, norms, eps, xn, qkv, qkv_out, heads, cos, sin, factor, q, k, kv, layer, rows,
                          slots):  # pragma: no cover - compiled
    """Gemma 3's attention_input: the input RMSNorm (1 + weight), q/k/v, q_norm and k_norm per head, RoPE of q and k,
    q times `factor` (a float32 multiply, torch's; 1.0: none, as the module's query_factor None), the keys and
    values into the paged cache (a window layer: rows empty, its cache written by the caller).
    norms: the layer's (input, post_attention, pre_feedforward, post_feedforward, q_norm, k_norm) weights;
    heads: scratch (q_rows (R * Hq, D), q_normed (R, Hq * D), k_rows (R * Hkv, D), k_normed (R, Hkv * D))."""
    rms_norm(h, norms[0], 1.0, eps, xn)
    _product(mode, qkv[0], xn, qkv[1], qkv[2], qkv[3], qkv_out)
    nq, nk = q.shape[1] * q.shape[2], k.shape[1] * k.shape[2]
    _norm_heads(qkv_out, 0, norms[4], eps, heads[0], heads[1])
    _norm_heads(qkv_out, nq, norms[5], eps, heads[2], heads[3])
    _rope_heads(heads[1], 0, cos, sin, q)
    _rope_heads(heads[3], 0, cos, sin, k)
    if factor != 1.0:
        f = np.float32(factor)
        for r in range(q.shape[0]):
            for hh in range(q.shape[1]):
                for j in range(q.shape[2]):
                    q[r, hh, j] = q[r, hh, j] * f
    _store(k, qkv_out, nq + nk, kv, layer, rows, slots)


@njit(cache=True)
def gemma_mlp_input(mode, attn, o, o_out, h, norms, eps, post, xn, gate_up, gate_up_out):  # pragma: no cover - compiled
    """Gemma 3's mlp_input: o_proj, the post-attention RMSNorm of its output (into post), the residual add, the
    pre-feedforward RMSNorm and the fused gate/up product (every norm 1 + weight; norms as gemma_attention_input's)."""
    _product(mode, o[0], attn, o[1], o[2], o[3], o_out)
    rms_norm(o_out, norms[1], 1.0, eps, post)
    _add(h, post)
    rms_norm(h, norms[2], 1.0, eps, xn)
    _product(mode, gate_up[0], xn, gate_up[1], gate_up[2], gate_up[3], gate_up_out)


@njit(cache=True, inline="always")
def _gemma_mlp_end(mode, act, down, down_out, h, norms, eps, post):  # pragma: no cover - compiled
    """down_proj, the post-feedforward RMSNorm of its output (into post) and the residual add."""
    _product(mode, down[0], act, down[1], down[2], down[3], down_out)
    rms_norm(down_out, norms[3], 1.0, eps, post)
    _add(h, post)


@njit(cache=True)
def gemma_mlp_output(mode, act, down, down_out, h, norms, eps, post, xn, next_norms, qkv, qkv_out, heads, cos, sin, factor,
                     q, k, kv, layer, rows, slots):  # pragma: no cover - compiled
    """Gemma 3's mlp_output: down_proj, the post-feedforward RMSNorm, the residual add, then the next layer's
    gemma_attention_input (next_norms its weights)."""
    _gemma_mlp_end(mode, act, down, down_out, h, norms, eps, post)
    gemma_attention_input(mode, h, next_norms, eps, xn, qkv, qkv_out, heads, cos, sin, factor, q, k, kv, layer, rows, slots)


@njit(cache=True)
def gemma_final_output(mode, act, down, down_out, h, norms, eps, post, final_w, final_eps, out):  # pragma: no cover
    """Gemma 3's last layer's down_proj, post-feedforward RMSNorm and residual add, then the model's final RMSNorm
    (1 + final_w, final_eps) into out."""
    _gemma_mlp_end(mode, act, down, down_out, h, norms, eps, post)
    rms_norm(h, final_w, 1.0, final_eps, out)


__all__ = ["FLOAT32", "FORMAT_CODES", "INT8", "Q4_0", "Q4_1", "Q8_0", "Q8_0_INT16", "attention_input", "final_output",
           "gemma_attention_input", "gemma_final_output", "gemma_mlp_input", "gemma_mlp_output", "mlp_input", "mlp_output",
           "norm_gate_up", "product", "residual_attention_input", "residual_final_norm", "window_store"]
