"""The CPU kernel of prompt logprobs' reductions over one chunk of logits, compiled by numba.

    reduce_chunk(logits, target, first, maxes, sums, larger, values, ids)

    >>> import numpy as np
    >>> from treeattn.ops.logits_cpu_kernel import reduce_chunk
    >>> logits = np.array([[0.0, 2.0, 1.0], [3.0, 3.0, -1.0]], dtype=np.float32)
    >>> maxes, sums, larger = (np.empty(2, dtype=np.float32) for _ in range(3))
    >>> values, ids = np.full((2, 2), -np.inf, dtype=np.float32), np.zeros((2, 2), dtype=np.int64)
    >>> reduce_chunk(logits, logits[:, 2].copy(), 100, maxes, sums, larger, values, ids)
    >>> maxes.tolist(), larger.tolist(), values.tolist(), ids.tolist()
    ([2.0, 3.0], [1.0, 2.0], [[2.0, 1.0], [3.0, 3.0]], [[101, 102], [100, 101]])
    >>> bool(np.allclose(sums, [np.exp([-2.0, 0.0, -1.0]).sum(), np.exp([0.0, 0.0, -4.0]).sum()], rtol=3e-7))
    True

logits (R, C) float32 C-contiguous: a block's rows x a chunk of the vocabulary (its first column is token `first`);
target (R,) float32: each row's target logit. For every row r (4-16 KiB: read from memory once, then from L1),
written into the (R,) float32 arrays:

    maxes[r]  = max of the row                                              (one vectorized loop)
    sums[r]   = sum of exp(logit - maxes[r]): each term in float32 into a row buffer, with the count below
                (a second loop), then summed in float64 (a third), rounded once to float32
    larger[r] = the number of logits strictly above target[r] (exact: C < 2**24)

and the row's running top k (values (R, k) float32, most likely first, ids (R, k) int64: token ids), which the call
updates with the chunk's logits (k = 0: nothing; start them at -inf and any id): only a row whose max is above its
k-th value is scanned again, and a logit enters only when strictly above the k-th value, so of equal logits the
earlier (lower id) comes first.

exp is not libm's: numba vectorizes no loop that calls expf without Intel's SVML (not a dependency here). _exp2 is
exp2 of a non-positive float32 y, vectorized: y = n + f (n = round(y), |f| <= 1/2), 2**f by its Taylor polynomial of
degree 7 in f*ln 2 (truncation error 5e-9 relative) in float32, times 2**n made from its bits; y below -126 counts as
-126 (2**-126 = 1.2e-38: far below a sum's float32 resolution, the sum holding the max's 1). Within 6.7e-8 of
float64's exp2 relatively over [-126, 0] (docs/data/logp23/kernel_accuracy.txt; tests/test_logits_cpu_kernel.py
bounds it by 3e-7); a NaN logit gives a NaN sum, as torch's reductions do.

Each helper is its own compiled function (not inlined by numba, which would give it its caller's fast-math flags;
LLVM inlines it afterwards, keeping each instruction's flags), its loops on 512-bit vectors where the CPU has them
(packed_cpu_kernel._prefer_512_bit_vectors). Importing this module compiles nothing: numba compiles reduce_chunk on
its first call and caches the machine code beside this file (cache=True); the ranks call it at start (ops.warmup).
"""

from __future__ import annotations

import math

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from treeattn.ops.numba_cache import lock_cache_saves
from treeattn.ops.packed_cpu_kernel import _prefer_512_bit_vectors

lock_cache_saves()  # before any cached kernel is compiled or saved: other processes may save beside this one

_LN2 = math.log(2.0)
_TAYLOR = tuple(_LN2 ** i / math.factorial(i) for i in range(8))  # 2**f = sum (f ln 2)**i / i!, i = 0..7
_C0, _C1, _C2, _C3, _C4, _C5, _C6, _C7 = (np.float32(c) for c in _TAYLOR)
_LOG2_E = np.float32(1.0 / _LN2)


@intrinsic
def _float32_bits(typingctx, bits):
    """The float32 whose bits are the int32 `bits` (LLVM's bitcast: no conversion, vectorizable)."""
    if bits != types.int32:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())

    return types.float32(types.int32), codegen


@intrinsic
def _larger(typingctx, a, b):
    """The larger of two float32 (llvm.maxnum, flagged nnan nsz: a reduction of it vectorizes; numba's own max, a
    compare and a select, did not). With a NaN operand either may come back: the caller's sum catches NaNs."""
    if a != types.float32 or b != types.float32:
        return None

    def codegen(context, builder, signature, args):
        f32 = ir.FloatType()
        maxnum = cgutils.get_or_insert_function(builder.module, ir.FunctionType(f32, [f32, f32]), "llvm.maxnum.f32")
        return builder.call(maxnum, args, fastmath=("nnan", "nsz"))

    return types.float32(types.float32, types.float32), codegen


@njit(cache=True, fastmath={"contract"})
def _exp2(y):  # pragma: no cover - compiled
    """2**y for a float32 y <= 0 (see the module doc); NaN for NaN."""
    clamped = y if y >= np.float32(-126.0) else np.float32(-126.0)  # NaN too: the bits below stay defined
    n = np.floor(clamped + np.float32(0.5))
    f = clamped - n
    p = _C7 * f + _C6
    p = p * f + _C5
    p = p * f + _C4
    p = p * f + _C3
    p = p * f + _C2
    p = p * f + _C1
    p = p * f + _C0
    power = p * _float32_bits(np.int32((np.int64(n) + 127) << 23))
    return power if y == y else y  # NaN stays NaN


@njit(cache=True)
def _row_max(logits, r):  # pragma: no cover - compiled
    """The largest of row r of a float32 (R, C) array (vectorized; a NaN in the row may be skipped here, and then
    the sum, which keeps strict math, is NaN)."""
    _prefer_512_bit_vectors()
    m = np.float32(-np.inf)
    for i in range(logits.shape[1]):
        m = _larger(logits[r, i], m)
    return m


@njit(cache=True, fastmath={"reassoc", "contract"})
def _terms_and_count(logits, r, m, target, terms):  # pragma: no cover - compiled
    """terms[i] = exp(logits[r, i] - m); returns the count of row r's logits above target, in float32 (exact below
    2**24; float32's 16 lanes, as the logits'). reassoc lets the count's sum vectorize; _exp2 keeps its own flags."""
    _prefer_512_bit_vectors()
    above = np.float32(0.0)
    for i in range(logits.shape[1]):
        x = logits[r, i]
        terms[i] = _exp2((x - m) * _LOG2_E)
        above += np.float32(x > target)
    return above


@njit(cache=True, fastmath={"reassoc"})
def _sum(terms):  # pragma: no cover - compiled
    """The float64 sum of float32 terms (a row's exponentials, in L1: vectorized, 8 lanes)."""
    _prefer_512_bit_vectors()
    total = 0.0
    for i in range(terms.shape[0]):
        total += np.float64(terms[i])
    return total


@njit(cache=True)
def _insert(logits, r, first, values, ids):  # pragma: no cover - compiled
    """Merge row r's logits into its sorted top k (row r of values, ids)."""
    k = values.shape[1]
    for i in range(logits.shape[1]):
        x = logits[r, i]
        if x > values[r, k - 1]:
            at = k - 1
            while at > 0 and values[r, at - 1] < x:  # equal values keep their earlier place
                values[r, at] = values[r, at - 1]
                ids[r, at] = ids[r, at - 1]
                at -= 1
            values[r, at] = x
            ids[r, at] = first + i


@njit(cache=True, nogil=True)
def reduce_chunk(logits, target, first, maxes, sums, larger, values, ids):  # pragma: no cover - compiled
    """Each row's max, sum of exp(logit - max), count above its target and top k over a chunk (see the module doc)."""
    k = values.shape[1]
    terms = np.empty(logits.shape[1], dtype=np.float32)  # a row's exponentials, summed in float64 after
    for r in range(logits.shape[0]):
        m = _row_max(logits, r)
        larger[r] = _terms_and_count(logits, r, m, target[r], terms)
        maxes[r] = m
        sums[r] = np.float32(_sum(terms))
        if k and m > values[r, k - 1]:  # some logit of the row enters its top k
            _insert(logits, r, first, values, ids)
