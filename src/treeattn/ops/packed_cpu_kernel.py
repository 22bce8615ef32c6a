"""The CPU kernel of a linear layer whose weight is kept in ggml's block formats (treeattn.ops.packed_linear), compiled by numba.

    out[i, n] = sum_k x[i, k] * w[n, k]        x: (M, K) float32, w: (N, K) in blocks of 32 along K

A decode step multiplies a few rows of activations (M <= packed_linear.MAX_KERNEL_ROWS) by every
weight matrix once: a GEMV whose time is the time to stream the weight. A float32 weight streams 32
bits per value; a q4_1 block 16 bytes of 4-bit values and two float32 scales for 32 weights (6 bits
a weight). This kernel reads the blocks as they are, dequantizes each block in registers and
accumulates in float32; ranges of output rows are split over threads (prange).

Formats (ggml's blocks of 32 weights along a row; the scales d, m are the file's float16 values,
widened to float32 once at load, exactly):
    q4_0: 16 bytes, byte j holds weight j (low nibble) and weight j + 16 (high nibble); w = d * (q - 8)
    q4_1: the same 16 bytes;                                                               w = d * q + m
    q8_0: 32 int8;                                                                         w = d * q

Each weight is computed in float32 as ggml and gguf.quants compute it (d * q is exact in float32:
an 11-bit mantissa times an integer below 256; for q4_1 the + m rounds once, the same with or without
a fused multiply-add), so the kernel multiplies by exactly the values a float32 dequantization holds.
The only difference from x @ W in float64 is the float32 accumulation of the dot products: 16 or 32
lanes along the row, then the lanes' sum (fastmath here is reassociation and contraction only).

The accumulators live on the stack (_stack_floats: an LLVM alloca), not in a numba array: LLVM then
knows they alias none of the argument arrays and keeps them in vector registers across a row's
blocks, where an np.zeros scratch (heap memory, which might be x or out) was loaded and stored at
every block: the kernels ran at 0.4-0.7x their present speed on one thread (docs/benchmarks.md,
"Session 11").

The loops ask for the weight blocks PREFETCH_BYTES ahead (llvm.prefetch, a hint: no value changes): an output
projection over the vocabulary is larger than the caches, and without the hint each row waited for memory (SmolLM2's
q8_0 head 0.55-0.61x the time with it, Gemma 3's 0.60x; docs/bench_weights.md, "Session 21 (f32h21)").

Importing this module compiles nothing: numba compiles each kernel on its first call and caches the
machine code beside this file (cache=True).
"""

from __future__ import annotations

import numba
import numpy as np
from numba import njit, prange
from numba.core import cgutils, types
from llvmlite import ir
from numba.extending import intrinsic

from treeattn.ops.llvm_prefetch import prefetch
from treeattn.ops.numba_cache import lock_cache_saves

lock_cache_saves()  # before any cached kernel is compiled or saved: other processes may save beside this one

_FASTMATH = {"reassoc", "contract"}
BLOCK = 32
# q4 weight rows per pass over x: 0.57-0.73x the time of one row at a time (docs/benchmarks.md, "Weights kept packed"). q8_0 stays
# at
# one row: grouping its rows was faster on a layer's matrices but 1.3x slower on a 49152-row output projection
# (session 11, with the accumulators on the stack: groups of 2 and 4 rows 0.5-0.8x one row's throughput on every matrix).
ROWS = 4
Q4_LANES = ROWS * 16  # a q4 group's accumulators: 16 lanes per weight row (a literal for _stack_floats)
PREFETCH_BYTES = 4096
"""How far ahead of the q8_0 block it multiplies the kernel asks for the weight bytes (the scales an eighth of it):
a matrix larger than the caches (an output projection over the vocabulary) is read as a stream, and without the
hint each row waited for memory (as packed_int8_kernel.PREFETCH_BYTES). A hint only: the products are the same."""
CHUNKS_PER_THREAD = 4  # row ranges per thread: small enough to balance, few enough that each range's lanes are allocated once


def matmul(threads: int, fmt: str, x, qs, d, m, out) -> None:
    """out = x @ W.T for a packed W of format `fmt` on `threads` threads (1: the serial compilation, no pool).

    x: (M, K) float32 C-contiguous; qs: (N, K // 32, 16) uint8 (q4_0, q4_1) or (N, K // 32, 32) int8
    (q8_0); d, m: (N, K // 32) float32 (m: q4_1 only; any float32 array otherwise); out: (M, N) float32.
    """
    threads = max(1, min(threads, numba.config.NUMBA_NUM_THREADS))
    if threads > 1:
        numba.set_num_threads(threads)  # per calling thread
    kernel = _KERNELS[fmt][threads > 1]
    chunks = 1 if threads == 1 else min(qs.shape[0], CHUNKS_PER_THREAD * threads)
    kernel(x, qs, d, m, out, chunks)


@intrinsic
def _stack_floats(typingctx, count):
    """A pointer to `count` (a literal int) float32 on the calling function's stack (one alloca in its
    entry block), uninitialized; view it with numba.carray. It never escapes the function, so LLVM can
    keep it in registers."""
    if not isinstance(count, types.IntegerLiteral):
        return None
    n = count.literal_value

    def codegen(context, builder, signature, args):
        return cgutils.alloca_once(builder, context.get_value_type(types.float32), size=n)

    return types.CPointer(types.float32)(count), codegen


@intrinsic
def _prefetch(typingctx, array, offset):
    """A hint to fetch the cache line at byte `offset` (an int) from the start of `array`'s data into every cache
    level (llvm.prefetch: read, keep; never faults, past the array's end included). Changes no value."""
    if not isinstance(array, types.Array) or not isinstance(offset, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        data = builder.bitcast(context.make_array(signature.args[0])(context, builder, args[0]).data, ir.IntType(8).as_pointer())
        prefetch(builder, data, context.cast(builder, args[1], signature.args[1], types.intp))
        return context.get_dummy_value()

    return types.void(array, offset), codegen


@intrinsic
def _prefer_512_bit_vectors(typingctx):
    """Marks the calling compiled function (after numba's inlining, the kernel whose loops follow) with LLVM's
    "prefer-vector-width"="512": its loops then vectorize over 16 float32 lanes where the CPU has AVX-512. LLVM's
    default for Intel's AVX-512 server CPUs (skylake-avx512 to sapphirerapids and emeraldrapids) is 256-bit
    vectors (its prefer-256-bit tuning), for AMD's Zen 4 and 5 512-bit already: there this attribute changes
    nothing (the same zmm code), on Intel the float32 kernel took 0.51-0.67x the time (issue 50; docs/bench_weights.md,
    "Session 20, Intel Xeon"). On a CPU without AVX-512 the widest legal vectors are used, as before. The
    paged attention kernel keeps LLVM's default: there 512-bit loops were slower on that Intel host."""
    def codegen(context, builder, signature, args):
        set.add(builder.function.attributes, '"prefer-vector-width"="512"')  # a string attribute llvmlite does not list
        return context.get_dummy_value()

    return types.void(), codegen


@njit(cache=True, fastmath=_FASTMATH, inline="always")
def _q4_rows(x, qs, d, m, out, n0, n1, offset, affine):  # pragma: no cover - compiled
    """Output columns n0..n1-1 of every row of x (see the module doc), ROWS weight rows at a time (each
    x element loaded once for all of them), then the remaining rows one by one."""
    _prefer_512_bit_vectors()
    acc = numba.carray(_stack_floats(Q4_LANES), (ROWS, 16))
    n = n0
    while n + ROWS <= n1:
        _q4_group(x, qs, d, m, out, n, ROWS, offset, affine, acc)
        n += ROWS
    while n < n1:
        _q4_group(x, qs, d, m, out, n, 1, offset, affine, acc)
        n += 1


@njit(cache=True, fastmath=_FASTMATH, inline="always")
def _q4_group(x, qs, d, m, out, n0, rows, offset, affine, acc):  # pragma: no cover - compiled
    """Output columns n0..n0+rows-1 of every row of x. Sixteen float32 lanes per weight row, one per
    byte of a block, each add a weight's product for the low and the high nibble; the lanes are
    summed at the end of the row (a vectorized loop: no reduction inside it; acc: (ROWS, 16) float32
    on the stack). A byte's nibbles are split in float32, exactly (byte = 16 * high + low, all below 256):
    numba widens integer arithmetic to 64 bits, which AVX2 cannot convert to float32 in vector registers."""
    M, nb = x.shape[0], qs.shape[1]
    off = np.float32(offset)
    for i in range(M):
        acc[:, :] = 0.0
        for b in range(nb):
            base = b * BLOCK
            _prefetch(qs, (n0 * nb + b * rows) * 16 + PREFETCH_BYTES)  # the group's blocks, PREFETCH_BYTES ahead
            _prefetch(d, (n0 * nb + b * rows) * 4 + PREFETCH_BYTES // 8)
            _prefetch(m, (n0 * nb + b * rows) * 4 + PREFETCH_BYTES // 8)
            for r in range(rows):
                db = d[n0 + r, b]
                mb = m[n0 + r, b] if affine else np.float32(0.0)
                for j in range(16):
                    byte = np.float32(qs[n0 + r, b, j])
                    high = np.floor(byte * np.float32(0.0625))
                    low = byte - np.float32(16.0) * high
                    acc[r, j] += x[i, base + j] * (db * (low - off) + mb) + x[i, base + 16 + j] * (db * (high - off) + mb)
        for r in range(rows):
            s = np.float32(0.0)
            for j in range(16):
                s += acc[r, j]
            out[i, n0 + r] = s


@njit(cache=True, fastmath=_FASTMATH, inline="always")
def _q8_rows(x, qs, d, out, n0, n1):  # pragma: no cover - compiled
    """Output columns n0..n1-1 of every row of x for a q8_0 weight (32 lanes, one per weight of a block); the
    blocks PREFETCH_BYTES ahead are asked for while a row's are multiplied (qs, d C-contiguous, as kernel_arrays gives)."""
    _prefer_512_bit_vectors()
    M, nb, width = x.shape[0], qs.shape[1], qs.shape[2] * qs.itemsize
    acc = numba.carray(_stack_floats(BLOCK), (BLOCK,))
    for n in range(n0, n1):
        for b in range(nb):
            _prefetch(qs, (n * nb + b) * width + PREFETCH_BYTES)
        _prefetch(d, n * nb * 4 + PREFETCH_BYTES // 8)
        for i in range(M):
            acc[:] = 0.0
            for b in range(nb):
                db = d[n, b]
                base = b * BLOCK
                for j in range(BLOCK):
                    acc[j] += x[i, base + j] * (db * np.float32(qs[n, b, j]))
            s = np.float32(0.0)
            for j in range(BLOCK):
                s += acc[j]
            out[i, n] = s


@njit(cache=True, fastmath=_FASTMATH)
def _q4_0_serial(x, qs, d, m, out, chunks):  # pragma: no cover - compiled
    """q4_0, every row on the calling thread."""
    _q4_rows(x, qs, d, m, out, 0, qs.shape[0], 8, False)


@njit(parallel=True, cache=True, fastmath=_FASTMATH)
def _q4_0_parallel(x, qs, d, m, out, chunks):  # pragma: no cover - compiled
    """q4_0, `chunks` ranges of rows over numba's threads."""
    N = qs.shape[0]
    for c in prange(chunks):
        _q4_rows(x, qs, d, m, out, c * N // chunks, (c + 1) * N // chunks, 8, False)


@njit(cache=True, fastmath=_FASTMATH)
def _q4_1_serial(x, qs, d, m, out, chunks):  # pragma: no cover - compiled
    """q4_1, every row on the calling thread."""
    _q4_rows(x, qs, d, m, out, 0, qs.shape[0], 0, True)


@njit(parallel=True, cache=True, fastmath=_FASTMATH)
def _q4_1_parallel(x, qs, d, m, out, chunks):  # pragma: no cover - compiled
    """q4_1, `chunks` ranges of rows over numba's threads."""
    N = qs.shape[0]
    for c in prange(chunks):
        _q4_rows(x, qs, d, m, out, c * N // chunks, (c + 1) * N // chunks, 0, True)


@njit(cache=True, fastmath=_FASTMATH)
def _q8_0_serial(x, qs, d, m, out, chunks):  # pragma: no cover - compiled
    """q8_0, every row on the calling thread."""
    _q8_rows(x, qs, d, out, 0, qs.shape[0])


@njit(parallel=True, cache=True, fastmath=_FASTMATH)
def _q8_0_parallel(x, qs, d, m, out, chunks):  # pragma: no cover - compiled
    """q8_0, `chunks` ranges of rows over numba's threads."""
    N = qs.shape[0]
    for c in prange(chunks):
        _q8_rows(x, qs, d, out, c * N // chunks, (c + 1) * N // chunks)


_KERNELS = {"q4_0": (_q4_0_serial, _q4_0_parallel), "q4_1": (_q4_1_serial, _q4_1_parallel),
            "q8_0": (_q8_0_serial, _q8_0_parallel)}
