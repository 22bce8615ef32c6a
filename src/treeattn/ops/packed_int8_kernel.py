"""Packed weights times 8-bit activations, as llama.cpp multiplies them on a CPU: AVX-512 VNNI (vpdpbusd), compiled by numba.

    if available(): matmul(threads, fmt, x, qs, d, m, out)     # out = x @ W.T, x quantized per block of 32

The float32 kernel (treeattn.ops.packed_cpu_kernel) multiplies the file's weights exactly; this one
does what llama.cpp does instead, so its results differ from the exact product by the activations'
rounding to 8 bits (about 0.4% of a block's largest value each):

1. Each row of x is quantized per block of 32 values as ggml's quantize_row_q8_0_ref does it (gguf.quants'
   Q8_0): d = max|x_j| / 127 (float32), q_j = roundf(x_j * (1 / d)) in -127..127 (0 for an all-zero block).
   ggml then stores d as a float16; here d stays float32 (one rounding less). For q4_1 the block's sum
   of q_j is kept too (ggml's q8_1 form: its d * sum is the term of the weights' offset m).
2. Each weight block times each x block is one exact int32 dot product of the quantized values, on
   vpdpbusd: u8 x s8 products summed in fours into int32 lanes, 64 per instruction. A q4 block's
   4-bit values are the unsigned operand as they are (0..15; q4_0's -8 is taken off once per block
   as 8 * sum q_j); a q8_0 block's int8 values are made unsigned by adding 128 (then 128 * sum q_j
   is taken off). The sums of q_j come from the quantization, so every integer is exact.
3. Each block's integer dot is scaled once: d_w * d_x * dot, accumulated in float32 (plus, for q4_1,
   m_w * d_x * sum q_j per block): llama.cpp's ggml_vec_dot_q4_0_q8_0 / q4_1_q8_1 / q8_0_q8_0 arithmetic.

The dot products are written in LLVM IR (numba intrinsics over llvm.x86.avx512.vpdpbusd.*): numba's own
loops compile to 16-bit multiply-adds of widened bytes at best (vpdpwssd), a quarter of the work per
instruction. So this module needs AVX-512 with VNNI, BW and VL (Intel since Cascade Lake, AMD since Zen 4):
available() says whether this host has them; nothing here is compiled on a host without them (numba
compiles on the first call; LLVM cannot select the instruction elsewhere). Importing this module
compiles nothing; machine code is cached beside it (cache=True), per CPU.
"""

from __future__ import annotations

import functools

import numba
import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from treeattn.ops.llvm_prefetch import prefetch
from treeattn.ops.numba_cache import lock_cache_saves

lock_cache_saves()  # before any cached kernel is compiled or saved: other processes may save beside this one

BLOCK = 32
NEEDS = ("avx512f", "avx512bw", "avx512vl", "avx512vnni")
"""The CPU features this kernel's instructions need (LLVM's names)."""
CHUNKS_PER_THREAD = 4
PREFETCH_BYTES = 4096
"""How far ahead of the weight bytes a row's dot product reads the next rows' are prefetched (their scales an
eighth of it): a matrix larger than the caches (Gemma 3's 262,144-row output projection) is read as a stream,
and without the hint each row's loads waited for memory between its dot products (16 ms a Gemma 3 head on one
thread where the same rows in cache took 5.4 and a plain read of its bytes 7.8)."""
_FASTMATH = {"reassoc", "contract"}
# Per format: 32-bit lanes a block's dot occupies, and what each lane's correction multiplies (0: none).
_Q4_LANES, _Q8_LANES = 4, 8
_OFFSETS = {"q4_0": 8, "q4_1": 0, "q8_0": 128}


@functools.lru_cache(maxsize=None)
def available() -> bool:
    """Whether this host (or numba's target CPU, NUMBA_CPU_FEATURES when set) has every feature of NEEDS."""
    features = numba.config.CPU_FEATURES
    if features:
        flags = {f[1:] for f in features.split(",") if f.startswith("+")}
        return all(n in flags for n in NEEDS)
    from llvmlite import binding

    host = binding.get_host_cpu_features()
    return all(host.get(n, False) for n in NEEDS)


def matmul(threads: int, fmt: str, x, qs, d, m, out) -> None:
    """out = x @ W.T with x quantized to 8 bits per block (see the module doc) on `threads` threads.

    x: (M, K) float32 C-contiguous; qs: (N, K // 32, 16) uint8 (q4_0, q4_1) or (N, K // 32, 32) int8 (q8_0);
    d, m: (N, K // 32) float32 (m: q4_1 only; any float32 array otherwise); out: (M, N) float32.
    Call only where available().
    """
    if not (x.flags.c_contiguous and qs.flags.c_contiguous and d.flags.c_contiguous and m.flags.c_contiguous):
        raise ValueError("x, qs, d and m must be C-contiguous arrays (the dot products read rows by pointer arithmetic)")
    threads = max(1, min(threads, numba.config.NUMBA_NUM_THREADS))
    if threads > 1:
        numba.set_num_threads(threads)
    chunks = 1 if threads == 1 else min(qs.shape[0], CHUNKS_PER_THREAD * threads)
    _KERNELS[fmt][threads > 1](x, qs, d, m, out, chunks)


@njit(cache=True)
def quantize_q8(x, xq, xd, xs):  # pragma: no cover - compiled
    """Rows of x (M, K) float32 as ggml's q8_0 blocks: xq (M, K // 32, 32) int8, xd (M, K // 32) float32 scales,
    xs (M, K // 32) int32 sums of each block's values. quantize_row_q8_0_ref's arithmetic (no fastmath: every
    operation rounds as written): d = amax / 127, id = 1 / d, q = roundf(x * id), roundf halves away from 0 (gguf.quants.Q8_0 bit
    for bit, before it rounds d to float16)."""
    M, nb = xq.shape[0], xq.shape[1]
    for i in range(M):
        for b in range(nb):
            amax = np.float32(0.0)
            finite = True
            for j in range(BLOCK):
                a = abs(x[i, b * BLOCK + j])
                finite = finite and a <= np.float32(3.4028235e38)  # False for inf and NaN
                amax = max(amax, a)
            dv = amax / np.float32(127.0) if finite else np.float32(np.nan)  # a non-finite x makes the block's products NaN
            inv = np.float32(1.0) / dv if finite and dv != np.float32(0.0) else np.float32(0.0)
            total = 0
            for j in range(BLOCK):
                v = x[i, b * BLOCK + j] * inv if finite else np.float32(0.0)
                a = abs(v)
                q = np.floor(a)
                q += np.floor(np.float32(2.0) * (a - q))  # roundf as gguf.quants.np_roundf writes it: exact, halves away from 0
                q = -q if v < np.float32(0.0) else q
                xq[i, b, j] = np.int8(q)
                total += np.int32(q)
            xd[i, b] = dv
            xs[i, b] = total


@njit(cache=True)
def _arrange(xq, offset, lanes, xlo, xhi, corr):  # pragma: no cover - compiled
    """What the dot products read of a quantized row set: for q4 (lanes 4) each block's values 0..15 (xlo) and
    16..31 (xhi) apart; and corr (M, nb, lanes) int32: offset * the sum of the x values that meet lane l's
    four weight bytes (q4: x[4l..4l+3] and x[16+4l..16+4l+3]; q8: x[4l..4l+3])."""
    M, nb = xq.shape[0], xq.shape[1]
    for i in range(M):
        for b in range(nb):
            if lanes == _Q4_LANES:
                for j in range(16):
                    xlo[i, b, j] = xq[i, b, j]
                    xhi[i, b, j] = xq[i, b, 16 + j]
            for lane in range(lanes):
                s = 0
                for t in range(4):
                    s += np.int32(xq[i, b, 4 * lane + t])
                    if lanes == _Q4_LANES:
                        s += np.int32(xq[i, b, 16 + 4 * lane + t])
                corr[i, b, lane] = np.int32(offset * s)


def _declare(builder, width):
    """llvm.x86.avx512.vpdpbusd.<width>: acc (int32 lanes) += four u8 x s8 products per lane."""
    vec = ir.VectorType(ir.IntType(32), width // 32)
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vec, [vec, vec, vec]),
                                        f"llvm.x86.avx512.vpdpbusd.{width}")
    return fn, vec


def _load(builder, base, offset, vty):
    """A vector of type vty at element `offset` of the array data pointer `base` (unaligned)."""
    ptr = builder.gep(base, [offset])
    return builder.load(builder.bitcast(ptr, vty.as_pointer()), align=1)


def _splat(value, count, ty):
    return ir.Constant(ir.VectorType(ty, count), [value] * count)


def _block_dots(builder, q4, width, wq, xa, xb, corr, b0, lanes):
    """int32 lanes (width // 32 of them) of the dot products of the blocks starting at b0: weight bytes, x values
    (xa: lo or all, xb: hi), minus the corrections."""
    fn, ivec = _declare(builder, width)
    nbytes = width // 8
    i8vec = ir.VectorType(ir.IntType(8), nbytes)
    per = 16 if q4 else 32  # weight bytes per block
    w = _load(builder, wq, builder.mul(b0, ir.Constant(ir.IntType(64), per)), i8vec)
    xoff = builder.mul(b0, ir.Constant(ir.IntType(64), per))
    zero = ir.Constant(ivec, None)
    if q4:
        lo = builder.and_(w, _splat(15, nbytes, ir.IntType(8)))
        hi = builder.lshr(w, _splat(4, nbytes, ir.IntType(8)))
        acc = builder.call(fn, [zero, builder.bitcast(lo, ivec), builder.bitcast(_load(builder, xa, xoff, i8vec), ivec)])
        acc = builder.call(fn, [acc, builder.bitcast(hi, ivec), builder.bitcast(_load(builder, xb, xoff, i8vec), ivec)])
    else:
        u = builder.xor(w, _splat(-128, nbytes, ir.IntType(8)))  # int8 + 128 as u8
        acc = builder.call(fn, [zero, builder.bitcast(u, ivec), builder.bitcast(_load(builder, xa, xoff, i8vec), ivec)])
    if corr is not None:
        acc = builder.sub(acc, _load(builder, corr, builder.mul(b0, ir.Constant(ir.IntType(64), lanes)), ivec))
    return acc


def _scaled(builder, acc, dw, xd, b0, blocks, lanes, sum_vec):
    """sum_vec + float(acc) * (d_w * d_x of each block, spread over its lanes)."""
    count = blocks * lanes
    f = builder.sitofp(acc, ir.VectorType(ir.FloatType(), count))
    fv = ir.VectorType(ir.FloatType(), blocks)
    s = builder.fmul(_load(builder, dw, b0, fv), _load(builder, xd, b0, fv))
    spread = builder.shuffle_vector(s, ir.Constant(fv, None), ir.Constant(ir.VectorType(ir.IntType(32), count),
                                                                          [k // lanes for k in range(count)]))
    return builder.fadd(sum_vec, builder.fmul(f, spread, flags=("contract",)), flags=("contract",))


def _halves(builder, vec, count):
    """The two halves of a float vector of `count` lanes, added lane by lane: count // 2 lanes."""
    half = count // 2
    lo = builder.shuffle_vector(vec, vec, ir.Constant(ir.VectorType(ir.IntType(32), half), list(range(half))))
    hi = builder.shuffle_vector(vec, vec, ir.Constant(ir.VectorType(ir.IntType(32), half), list(range(half, count))))
    return builder.fadd(lo, hi)


def _hsum(builder, main, tail, lanes):
    """The sum of the 16 lanes of `main` and the `lanes` lanes of `tail`, as a tree of halvings (a few
    shuffles and adds deep, where a chain of 20 scalar adds waited on each other)."""
    count = 16
    while count > lanes:
        main = _halves(builder, main, count)
        count //= 2
    vec = builder.fadd(main, tail)
    while count > 1:
        vec = _halves(builder, vec, count)
        count //= 2
    return builder.extract_element(vec, ir.Constant(ir.IntType(32), 0))


def _row_dot_codegen(q4: bool, with_corr: bool):
    """An intrinsic: sum over the blocks of one weight row and one quantized x row of d_w * d_x * int dot."""
    lanes = _Q4_LANES if q4 else _Q8_LANES
    group = 16 // lanes  # blocks per 512-bit step

    def typer(typingctx, wq, wrow, dw, xa, xb, xrow, corr, xd, nb):
        sig = types.float32(wq, wrow, dw, xa, xb, xrow, corr, xd, nb)

        def codegen(context, builder, signature, args):
            i64 = ir.IntType(64)
            arrays = [context.make_array(signature.args[k])(context, builder, args[k]) for k in (0, 2, 3, 4, 6, 7)]
            wq_a, dw_a, xa_a, xb_a, corr_a, xd_a = arrays
            wrow_v, xrow_v, nb_v = args[1], args[5], args[8]
            i8p = ir.IntType(8).as_pointer()
            per = 16 if q4 else 32
            wbase = builder.gep(builder.bitcast(wq_a.data, i8p), [builder.mul(wrow_v, builder.mul(nb_v, ir.Constant(i64, per)))])
            xa_base = builder.gep(builder.bitcast(xa_a.data, i8p), [builder.mul(xrow_v, builder.mul(nb_v,
                                                                                                    ir.Constant(i64, per)))])
            xb_base = builder.gep(builder.bitcast(xb_a.data, i8p), [builder.mul(xrow_v, builder.mul(nb_v,
                                                                                                    ir.Constant(i64, per)))])
            dw_base = builder.gep(dw_a.data, [builder.mul(wrow_v, nb_v)])
            xd_base = builder.gep(xd_a.data, [builder.mul(xrow_v, nb_v)])
            corr_base = (
                builder.gep(corr_a.data, [builder.mul(xrow_v, builder.mul(nb_v, ir.Constant(i64, lanes)))]) if with_corr else None
            )
            main = cgutils.alloca_once_value(builder, ir.Constant(ir.VectorType(ir.FloatType(), 16), None))
            tail = cgutils.alloca_once_value(builder, ir.Constant(ir.VectorType(ir.FloatType(), lanes), None))
            groups = builder.udiv(nb_v, ir.Constant(i64, group))
            prefetch(builder, builder.bitcast(dw_base, i8p), ir.Constant(i64, PREFETCH_BYTES // 8))
            with cgutils.for_range(builder, groups) as loop:
                b0 = builder.mul(loop.index, ir.Constant(i64, group))
                prefetch(builder, wbase, builder.add(builder.mul(b0, ir.Constant(i64, per)), ir.Constant(i64, PREFETCH_BYTES)))
                acc = _block_dots(builder, q4, 512, wbase, xa_base, xb_base, corr_base, b0, lanes)
                builder.store(_scaled(builder, acc, dw_base, xd_base, b0, group, lanes, builder.load(main)), main)
            start = builder.mul(groups, ir.Constant(i64, group))
            with cgutils.for_range_slice(builder, start, nb_v, ir.Constant(i64, 1), inc=True) as (b, _):
                acc = _block_dots(builder, q4, lanes * 32, wbase, xa_base, xb_base, corr_base, b, lanes)
                builder.store(_scaled(builder, acc, dw_base, xd_base, b, 1, lanes, builder.load(tail)), tail)
            return _hsum(builder, builder.load(main), builder.load(tail), lanes)

        return sig, codegen

    return typer


_row_dot_q4 = intrinsic(_row_dot_codegen(True, True))  # q4_0: minus 8 * sums
_row_dot_q4_affine = intrinsic(_row_dot_codegen(True, False))  # q4_1: the offsets' term apart
_row_dot_q8 = intrinsic(_row_dot_codegen(False, True))  # q8_0: minus 128 * sums


@njit(cache=True, inline="always")
def _prepare(x, nb, lanes, offset):  # pragma: no cover - compiled
    M = x.shape[0]
    xq = np.empty((M, nb, BLOCK), dtype=np.int8)
    xd = np.empty((M, nb), dtype=np.float32)
    xs = np.empty((M, nb), dtype=np.int32)
    quantize_q8(x, xq, xd, xs)
    half = 16 if lanes == _Q4_LANES else 0
    xlo = np.empty((M, nb, half), dtype=np.int8)
    xhi = np.empty((M, nb, half), dtype=np.int8)
    corr = np.empty((M, nb, lanes), dtype=np.int32)
    _arrange(xq, offset, lanes, xlo, xhi, corr)
    sx = np.empty((M, nb), dtype=np.float32)  # d_x * sum q_x: ggml's q8_1 s (in float32), once per x row
    for i in range(M):
        for b in range(nb):
            sx[i, b] = xd[i, b] * np.float32(xs[i, b])
    return xq, xd, sx, xlo, xhi, corr


@njit(cache=True, fastmath=_FASTMATH, inline="always")
def _q4_rows(qs, d, m, out, n0, n1, xd, xs, xlo, xhi, corr, affine):  # pragma: no cover - compiled
    """Output columns n0..n1-1 of every quantized x row (xs: d_x * sum q_x per block, for q4_1's offsets)."""
    M, nb = xd.shape[0], qs.shape[1]
    for n in range(n0, n1):
        for i in range(M):
            if affine:
                s = _row_dot_q4_affine(qs, n, d, xlo, xhi, i, corr, xd, nb)
                for b in range(nb):  # the offsets: m_w * (d_x * sum q_x), ggml's q8_1 s term
                    s += m[n, b] * xs[i, b]
            else:
                s = _row_dot_q4(qs, n, d, xlo, xhi, i, corr, xd, nb)
            out[i, n] = s


@njit(cache=True, fastmath=_FASTMATH, inline="always")
def _q8_rows(qs, d, out, n0, n1, xq, xd, corr):  # pragma: no cover - compiled
    M, nb = xd.shape[0], qs.shape[1]
    for n in range(n0, n1):
        for i in range(M):
            out[i, n] = _row_dot_q8(qs, n, d, xq, xq, i, corr, xd, nb)


@njit(cache=True, fastmath=_FASTMATH)
def _q4_0_serial(x, qs, d, m, out, chunks):  # pragma: no cover - compiled
    xq, xd, xs, xlo, xhi, corr = _prepare(x, qs.shape[1], _Q4_LANES, 8)
    _q4_rows(qs, d, m, out, 0, qs.shape[0], xd, xs, xlo, xhi, corr, False)


@njit(parallel=True, cache=True, fastmath=_FASTMATH)
def _q4_0_parallel(x, qs, d, m, out, chunks):  # pragma: no cover - compiled
    xq, xd, xs, xlo, xhi, corr = _prepare(x, qs.shape[1], _Q4_LANES, 8)
    N = qs.shape[0]
    for c in prange(chunks):
        _q4_rows(qs, d, m, out, c * N // chunks, (c + 1) * N // chunks, xd, xs, xlo, xhi, corr, False)


@njit(cache=True, fastmath=_FASTMATH)
def _q4_1_serial(x, qs, d, m, out, chunks):  # pragma: no cover - compiled
    xq, xd, xs, xlo, xhi, corr = _prepare(x, qs.shape[1], _Q4_LANES, 0)
    _q4_rows(qs, d, m, out, 0, qs.shape[0], xd, xs, xlo, xhi, corr, True)


@njit(parallel=True, cache=True, fastmath=_FASTMATH)
def _q4_1_parallel(x, qs, d, m, out, chunks):  # pragma: no cover - compiled
    xq, xd, xs, xlo, xhi, corr = _prepare(x, qs.shape[1], _Q4_LANES, 0)
    N = qs.shape[0]
    for c in prange(chunks):
        _q4_rows(qs, d, m, out, c * N // chunks, (c + 1) * N // chunks, xd, xs, xlo, xhi, corr, True)


@njit(cache=True, fastmath=_FASTMATH)
def _q8_0_serial(x, qs, d, m, out, chunks):  # pragma: no cover - compiled
    xq, xd, xs, xlo, xhi, corr = _prepare(x, qs.shape[1], _Q8_LANES, 128)
    _q8_rows(qs, d, out, 0, qs.shape[0], xq, xd, corr)


@njit(parallel=True, cache=True, fastmath=_FASTMATH)
def _q8_0_parallel(x, qs, d, m, out, chunks):  # pragma: no cover - compiled
    xq, xd, xs, xlo, xhi, corr = _prepare(x, qs.shape[1], _Q8_LANES, 128)
    N = qs.shape[0]
    for c in prange(chunks):
        _q8_rows(qs, d, out, c * N // chunks, (c + 1) * N // chunks, xq, xd, corr)


_KERNELS = {"q4_0": (_q4_0_serial, _q4_0_parallel), "q4_1": (_q4_1_serial, _q4_1_parallel),
            "q8_0": (_q8_0_serial, _q8_0_parallel)}
