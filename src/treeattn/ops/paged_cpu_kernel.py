"""The CPU kernel of paged decode attention (treeattn.ops.paged_decode), compiled by numba.

One pass over the blocks each query row sees, read in place from the cache's arena: for every
visible key of a block, the G query heads that share its KV head take their dot products with it;
an online softmax (running max, sum and unnormalized output, float32) folds the block in, its
scores' exps computed in one vectorized pass (_exp_shifted, float32 operations within 1.3 ulp of
exp), and every value row is added with its weight. Every K and V byte is read once per query row,
with no copy, no repeat of K/V across the query group and no score matrix beyond one block's
(Hkv x G x block_size floats). The blocks of a row are split into
contiguous ranges processed in parallel (flash-decoding); merge_splits then merges the ranges'
states exactly, as merge_states does. With float16 (or fp8, dequantized) blocks, head dim 64 and a key row's query heads in one
tile, the scores are taken in register tiles (_score_tile: each key chunk widened once for its query heads,
the tile's 16-lane sums reduced by one transpose-and-add; docs/bench_kernels.md, "Session 16"). Where a key row's
query heads fit 16 and the value dim is a multiple of 64, the values are summed in register tiles too
(_value_tile: 4 keys, each value row widened once for its query heads, the sums loaded and stored once per tile),
and a block's scores have padded rows (_SCORE_PAD: Llama-3.2-1B's 32 rows of 1 KiB fell in 4 L1 sets;
docs/bench_kernels.md, "Session 17").

Importing this module compiles nothing: numba compiles each kernel on its first call and caches
the machine code beside this file (cache=True), so later processes load it in a fraction of a
second. fastmath is limited to reassociation and contraction (the dot products' sums are
vectorized: float32 sums in another order); no assumption about NaN or infinities is made, so
masked rows stay -inf and a NaN in the inputs stays NaN (the engine never samples from it).

Stored dtypes: the blocks are float32, or 16-bit (a bfloat16 or float16 cache, the engine's
--kv-cache-dtype) passed as their bit patterns: bfloat16 as uint16, float16 as int16 (the array
type tells the kernel the format; numba has no float16 on the CPU). A 16-bit element is widened to
float32 in registers where the loops read it (exactly: every bfloat16 and float16 is a float32):
bfloat16 by a shift into a float32's high half, float16 by LLVM's fpext (F16C's vcvtph2ps; on a
CPU without F16C by integer operations, exactly too: _float16_bits_to_float32), both
vectorized (_wide); queries, scores, the softmax and the output stay float32. Session 8's kernel
widened every 16-bit block into a float32 scratch block first, which made a 16-bit cache slower than
a float32 one; 30 layers of 4096 keys, one thread, session 9's kernel and this one in alternating
processes: bfloat16 14.4-16.2 -> 8.5-8.9 ms, float16 18.1-21.9 -> 8.5-8.9 ms, float32 the same code
(docs/benchmarks.md, "Session 10").

fp8 blocks (an fp8_e4m3 cache: e4m3 codes passed as uint8, with float32 scales (NB, BS, Hkv), one
per key and KV head, treeattn.ops.fp8) are dequantized a block at a time into a float32 scratch block
(_block; an e4m3 code takes ~10 operations, which the G query heads of a group would otherwise
repeat): each code widened (exactly: every e4m3 code is a float32) times its scale, a power of two, so
the scratch holds exactly ops.fp8.dequantize_fp8's values. The loops then read that block as a float32
one, through the score and value tiles where the heads take them (session 19: SmolLM2's fp8 blocks
0.78-0.84x, Gemma 3's 0.92-0.95x the time of session 18's kernel, which multiplied each score by its
key's scale and each weight by its value's, key by key; docs/bench_kernels.md). Other dtypes ignore
the scales (pass NO_SCALES).
"""

from __future__ import annotations

import math

import numpy as np
import numba
from numba import njit, prange, types
from llvmlite import ir
from numba.core import cgutils
from numba.extending import intrinsic, overload

from treeattn.ops.llvm_prefetch import prefetch_lines
from treeattn.ops.numba_cache import lock_cache_saves

lock_cache_saves()  # before any cached kernel is compiled or saved: other processes may save beside this one

_FASTMATH = {"reassoc", "contract"}


_CONSTANT_HEAD_DIMS = (64,)
"""Head dims (keys' and values' alike) compiled as constants: the loops over a row then have a known
trip count, with no checks and remainders around each vector loop. Measured one thread, alternated with
the kernel before under load (docs/bench_kernels.md, "Session 15"): head dim 64 (SmolLM2's and
Llama-3.2-1B's heads, 4K and 16K keys) 0.77-1.0x the time; 256 (Gemma 3's) 1.03-1.19x slower, so
not kept; 128 not measured."""


def head_dim_tag(head_dim: int, dv: int) -> tuple:
    """The kernels' `dims` argument: a tuple of head_dim // 16 zeros when head_dim == dv is one of
    _CONSTANT_HEAD_DIMS (its length, a constant of the compiled code, gives the dims), else () (the
    dims read from the arrays' shapes).

    >>> len(head_dim_tag(64, 64)), head_dim_tag(64, 32), head_dim_tag(256, 256)
    (4, (), ())
    """
    return (0,) * (head_dim // 16) if head_dim == dv and head_dim in _CONSTANT_HEAD_DIMS else ()


def attend(threads: int, *args) -> None:
    """attend_parallel on `threads` threads (at most numba's pool; 1: attend_serial, no pool), with
    the head dims as constants where head_dim_tag has them."""
    threads = max(1, min(threads, numba.config.NUMBA_NUM_THREADS))
    dims = head_dim_tag(args[0].shape[3], args[5])
    heads, groups = head_shape_tag(args[0].shape[1], args[0].shape[2], args[0].shape[3], args[5])
    if threads == 1:
        attend_serial(*args, dims, heads, groups)
    else:
        numba.set_num_threads(threads)  # per calling thread
        attend_parallel(*args, dims, heads, groups)


def entry(threads: int, heads: int, group: int, head_dim: int, dv: int):
    """attend(threads, *args) for every call whose q rows are (R, heads, group, head_dim) and values dv wide, its
    choices (thread count, constant dims and heads) made once: entry(...)(*args) is that call (ops.cpu_decode.LayerCall
    runs every layer of a step through one).

    >>> entry(1, 3, 3, 64, 64) is not None
    True
    """
    threads = max(1, min(threads, numba.config.NUMBA_NUM_THREADS))
    tags = (head_dim_tag(head_dim, dv), *head_shape_tag(heads, group, head_dim, dv))
    if threads == 1:
        return lambda *args: attend_serial(*args, *tags)

    def parallel(*args) -> None:
        numba.set_num_threads(threads)  # per calling thread
        attend_parallel(*args, *tags)

    return parallel


NO_SCRATCH = np.zeros((0, 0, 0), dtype=np.float32)
NO_SCALES = np.ones((1, 1, 1), dtype=np.float32)
"""The scales argument of float32 and 16-bit blocks (never read)."""
# 2**120: e4m3's exponent bias (7) -> float32's (127); also normalizes e4m3's subnormals exactly.
_FP8_BIAS = np.float32(2.0**120)


def _wide(x):  # pragma: no cover - replaced by its overload inside compiled code
    raise NotImplementedError


def _i32(value):
    return ir.Constant(ir.IntType(32), value)


@intrinsic
def _bfloat16_bits_to_float32(typingctx, x):
    """The float32 of a bfloat16's bits (uint16): the bits shifted into a float32's high half (exact)."""
    if x != types.uint16:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(builder.shl(builder.zext(args[0], ir.IntType(32)), _i32(16)), ir.FloatType())

    return types.float32(types.uint16), codegen


_HALF_BIAS = np.float32(2.0**112)  # float16's exponent bias (15) -> float32's (127); also normalizes its subnormals


def _has_f16c(context) -> bool:
    """Whether numba compiles for a CPU with F16C (its target features; NUMBA_CPU_NAME=generic: none)."""
    return "+f16c" in str(getattr(context.codegen(), "_tm_features", ""))


def _half_bits_in_integers(builder, bits):
    """float16 bits (i16) -> float32 without the CPU's conversion: exponent and mantissa moved into a
    float32's place, the sign on top, times 2**112 (exact, subnormals included); exponent 31 keeps
    its mantissa under an all-ones float32 exponent (infinities, NaNs)."""
    code = builder.zext(bits, ir.IntType(32))
    magnitude = builder.and_(code, _i32(0x7FFF))
    placed = builder.or_(builder.shl(magnitude, _i32(13)), builder.shl(builder.and_(code, _i32(0x8000)), _i32(16)))
    value = builder.fmul(builder.bitcast(placed, ir.FloatType()), ir.Constant(ir.FloatType(), float(_HALF_BIAS)))
    special = builder.bitcast(builder.or_(placed, _i32(0x7F800000)), ir.FloatType())
    return builder.select(builder.icmp_unsigned(">=", magnitude, _i32(0x7C00)), special, value)


@intrinsic
def _float16_bits_to_float32(typingctx, x):
    """The float32 of a float16's bits (int16), exact for every value, subnormals, infinities and
    NaNs included: LLVM's fpext from half where the CPU has F16C (vcvtph2ps), else in integers. A
    target without F16C (an old CPU, a VM that hides it, NUMBA_CPU_NAME=generic) would otherwise
    compile fpext to a call of compiler-rt's __extendhfsf2, which numba's JIT cannot resolve: LLVM
    aborted the process (issue 46)."""
    if x != types.int16:
        return None

    def codegen(context, builder, signature, args):
        if _has_f16c(context):
            return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())
        return _half_bits_in_integers(builder, args[0])

    return types.float32(types.int16), codegen


@intrinsic
def _float16_bits_to_float32_in_integers(typingctx, x):
    """_float16_bits_to_float32's path for a CPU without F16C, on any CPU (its test)."""
    if x != types.int16:
        return None

    def codegen(context, builder, signature, args):
        return _half_bits_in_integers(builder, args[0])

    return types.float32(types.int16), codegen


@intrinsic
def _fp8_e4m3_bits_to_float32(typingctx, x):
    """The float32 of an e4m3fn code (uint8; no infinities, S.1111.111 is NaN), without its scale:
    exponent and mantissa moved into a float32's place, the sign on top, times 2**120 (e4m3's exponent
    bias -> float32's; it normalizes e4m3's subnormals too), exact; NaN for the NaN codes."""
    if x != types.uint8:
        return None

    def codegen(context, builder, signature, args):
        code = builder.zext(args[0], ir.IntType(32))
        magnitude = builder.and_(code, _i32(0x7F))
        bits = builder.or_(builder.shl(magnitude, _i32(20)), builder.shl(builder.and_(code, _i32(0x80)), _i32(24)))
        value = builder.fmul(builder.bitcast(bits, ir.FloatType()), ir.Constant(ir.FloatType(), float(_FP8_BIAS)))
        is_nan = builder.icmp_unsigned("==", magnitude, _i32(0x7F))
        return builder.select(is_nan, ir.Constant(ir.FloatType(), float("nan")), value)

    return types.float32(types.uint8), codegen


@overload(_wide)
def _wide_impl(x):
    """A stored element as float32, widened in registers where the loops read it (exactly), so that
    they vectorize: float32 as it is, bfloat16 (uint16 bits), float16 (int16 bits), fp8 e4m3 (uint8
    codes; without their scales)."""
    if x == types.float32:
        return lambda x: x
    if x == types.uint16:
        return lambda x: _bfloat16_bits_to_float32(x)
    if x == types.int16:
        return lambda x: _float16_bits_to_float32(x)
    if x == types.uint8:
        return lambda x: _fp8_e4m3_bits_to_float32(x)
    return None


def _scratch(k, dv):  # pragma: no cover - replaced by its overload inside compiled code
    raise NotImplementedError


def _block(k, scales, blk, dv, scratch):  # pragma: no cover - replaced by its overload inside compiled code
    raise NotImplementedError


@overload(_scratch)
def _scratch_impl(k, dv):
    """A float32 block (BS, Hkv, dv) to widen an fp8 block into; the other dtypes need none."""
    if k.dtype == types.uint8:
        return lambda k, dv: np.empty((k.shape[1], k.shape[2], dv), dtype=np.float32)
    return lambda k, dv: NO_SCRATCH


@overload(_block)
def _block_impl(k, scales, blk, dv, scratch):
    """Block blk of k, (BS, Hkv, >= dv), as the loops read it through _wide: the arena's own block
    (float32, 16-bit), or for fp8 its first dv channels dequantized into `scratch` (float32) once a block,
    each code times its scale scales[blk, t, h] (a power of two: exactly ops.fp8.dequantize_fp8's values),
    so that the query heads of a group and the value loop read float32 (widening an e4m3 code costs
    ~10 operations, once per query head where the loops read it) and the score and value tiles take fp8
    blocks as float32 ones (docs/bench_kernels.md, "Session 19")."""
    if k.dtype != types.uint8:
        return lambda k, scales, blk, dv, scratch: k[blk]

    def fp8(k, scales, blk, dv, scratch):
        src = k[blk]
        for t in range(src.shape[0]):
            for h in range(src.shape[1]):
                s = scales[blk, t, h]
                for d in range(dv):
                    scratch[t, h, d] = _wide(src[t, h, d]) * s
        return scratch

    return fp8


_TILE_SUMS = 16
"""Dot products a score tile (_score_tile) keeps in registers at most (16-lane float32 sums each)."""


def tile_shape(heads: int, group: int) -> tuple[int, int]:
    """(keys, KV heads) of a score tile for `heads` KV heads of `group` query heads: whole key rows (so
    that the tiles read a block in address order), as many keys as _TILE_SUMS sums allow.

    >>> tile_shape(3, 3), tile_shape(1, 4)
    ((1, 3), (4, 1))
    """
    return max(1, _TILE_SUMS // (heads * group)), heads


def _splat(constant):
    """A <16 x T> of one constant."""
    return ir.Constant(ir.VectorType(constant.type, 16), [constant.constant] * 16)


def _splat_value(builder, x):
    """A <16 x float> of the float x."""
    vec = builder.insert_element(ir.Constant(ir.VectorType(ir.FloatType(), 16), None), x, _i32(0))
    return builder.shuffle_vector(vec, vec, ir.Constant(ir.VectorType(ir.IntType(32), 16), [0] * 16))


def _vector_of(builder, context, kind, ptr):
    """16 stored elements at ptr as <16 x float>, widened exactly as _wide does (float32 as it is;
    bfloat16 bits shifted into a float32's high half; float16 by fpext with F16C, else in integers)."""
    f32 = ir.VectorType(ir.FloatType(), 16)
    if kind == types.float32:
        return builder.load(builder.bitcast(ptr, f32.as_pointer()), align=4)
    bits = builder.load(builder.bitcast(ptr, ir.VectorType(ir.IntType(16), 16).as_pointer()), align=2)
    if kind == types.uint16:
        return builder.bitcast(builder.shl(builder.zext(bits, ir.VectorType(ir.IntType(32), 16)), _splat(_i32(16))), f32)
    if _has_f16c(context):
        return builder.fpext(builder.bitcast(bits, ir.VectorType(ir.HalfType(), 16)), f32)
    code = builder.zext(bits, ir.VectorType(ir.IntType(32), 16))
    magnitude = builder.and_(code, _splat(_i32(0x7FFF)))
    placed = builder.or_(builder.shl(magnitude, _splat(_i32(13))),
                         builder.shl(builder.and_(code, _splat(_i32(0x8000))), _splat(_i32(16))))
    value = builder.fmul(builder.bitcast(placed, f32), _splat(ir.Constant(ir.FloatType(), float(_HALF_BIAS))))
    special = builder.bitcast(builder.or_(placed, _splat(_i32(0x7F800000))), f32)
    return builder.select(builder.icmp_unsigned(">=", magnitude, _splat(_i32(0x7C00))), special, value)


def _lane_sums(builder, vectors):
    """Every <16 x float> of `vectors` summed over its lanes, 16 sums a vector: [(sums, labels)], labels[lane]
    the index of the input summed there (-1: none). Pairs of vectors are halved and added with their halves
    interleaved (16 -> 8 -> 4 -> 2 -> 1 lanes an input), one add per pair and level instead of a
    horizontal sum per input; zero padding costs nothing."""
    n = -(-len(vectors) // 16) * 16
    items = [(v, [i] * 16) for i, v in enumerate(vectors)] + [(None, [-1] * 16)] * (n - len(vectors))
    mask = lambda idx: ir.Constant(ir.VectorType(ir.IntType(32), 16), idx)  # noqa: E731
    zero = ir.Constant(ir.VectorType(ir.FloatType(), 16), None)
    width = 8
    while width >= 1:
        merged = []
        for (a, la), (b, lb) in zip(items[0::2], items[1::2]):
            lo, hi, labels = [], [], []
            for s in range(0, 16, 2 * width):
                lo += list(range(s, s + width)) + list(range(16 + s, 16 + s + width))
                hi += list(range(s + width, s + 2 * width)) + list(range(16 + s + width, 16 + s + 2 * width))
                labels += la[s : s + width] + lb[s : s + width]
            if a is None and b is None:
                merged.append((None, labels))
                continue
            a, b = (zero if x is None else x for x in (a, b))
            total = builder.fadd(builder.shuffle_vector(a, b, mask(lo)), builder.shuffle_vector(a, b, mask(hi)),
                                 flags=("reassoc", "contract"))
            merged.append((total, labels))
        items = merged
        width //= 2
    return [item for item in items if item[0] is not None]


@intrinsic
def _score_tile(typingctx, q, r, kb, t0, h0, scores, sc, dims, heads, groups):
    """scores[h, g, t0 + i] = sc * (q[r, h, g] . kb[t0 + i, h]) for the tile_shape(H, G) = (T, HT) keys
    t0.. and KV heads h0.. of one query row (heads, groups: head_shape_tag's (0,) * H and (0,) * G;
    dims: head_dim_tag, D = 16 * len(dims)). Each key row is loaded and widened once for its G query heads,
    each query chunk once for the T keys, and the tile's dot products (16-lane sums in registers) are
    summed by one transpose-and-add (_lane_sums) instead of one horizontal sum each."""
    if not (all(isinstance(x, types.UniTuple) for x in (dims, heads, groups)) and sc == types.float32
            and kb.dtype in (types.float32, types.uint16, types.int16)):
        return None
    H, G = heads.count, groups.count
    chunks, (T, HT) = dims.count, tile_shape(H, G)
    i64 = ir.IntType(64)

    def codegen(context, builder, signature, args):
        c = lambda x: ir.Constant(i64, x)  # noqa: E731
        qa, ka, sa = (context.make_array(signature.args[i])(context, builder, args[i]) for i in (0, 2, 5))
        kd = cgutils.unpack_tuple(builder, ka.shape, 3)[2]
        bs = cgutils.unpack_tuple(builder, sa.shape, 3)[2]
        r_, t0_, h0_ = args[1], args[3], args[4]
        acc = {}
        for ch in range(chunks):
            for i in range(T):
                for hh in range(HT):
                    row = builder.add(builder.mul(builder.add(t0_, c(i)), c(H)), builder.add(h0_, c(hh)))
                    key = _vector_of(builder, context, signature.args[2].dtype,
                                     builder.gep(ka.data, [builder.add(builder.mul(row, kd), c(16 * ch))]))
                    for g in range(G):
                        at = builder.mul(builder.add(builder.mul(builder.add(builder.mul(r_, c(H)), builder.add(h0_, c(hh))),
                                                                 c(G)), c(g)), c(16 * chunks))
                        qv = _vector_of(builder, context, types.float32, builder.gep(qa.data, [builder.add(at, c(16 * ch))]))
                        prod = builder.fmul(qv, key, flags=("contract",))
                        acc[hh, g, i] = prod if ch == 0 else builder.fadd(acc[hh, g, i], prod, flags=("contract",))
        keys = list(acc)
        scale = _splat_value(builder, args[6])
        for total, labels in _lane_sums(builder, [acc[key] for key in keys]):
            total = builder.fmul(total, scale)
            for lane, label in enumerate(labels):
                if label >= 0:
                    hh, g, i = keys[label]
                    at = builder.add(builder.mul(builder.add(builder.mul(builder.add(h0_, c(hh)), c(G)), c(g)), bs),
                                     builder.add(t0_, c(i)))
                    builder.store(builder.extract_element(total, _i32(lane)), builder.gep(sa.data, [at]))
        return context.get_dummy_value()

    return types.void(q, r, kb, t0, h0, scores, sc, dims, heads, groups), codegen


@intrinsic
def _row_max(typingctx, scores, h, g, n, top):
    """max(top, scores[h, g, 0:n]) over the values that compare greater (NaN never does: the key-by-key
    `if x > top: top = x`), 16 lanes at a time (<16 x float> compare and select; the scalar loop compiles to one
    chain of vmaxss: 1.5 ns a score on this project's Intel Xeon, docs/data/dec21/max_loop_asm.txt), then the
    lanes and the last n % 16 scores one by one. Exact: a maximum is the same in any order (+0.0 and -0.0, equal,
    may swap)."""
    if not (isinstance(scores, types.Array) and scores.ndim == 3 and scores.layout == "C"
            and scores.dtype == types.float32 and top == types.float32):
        return None

    def codegen(context, builder, signature, args):
        i64, f32 = ir.IntType(64), ir.FloatType()
        vec = ir.VectorType(f32, 16)
        sa = context.make_array(signature.args[0])(context, builder, args[0])
        _, sg, sbs = cgutils.unpack_tuple(builder, sa.shape, 3)
        h_, g_, n_ = (context.cast(builder, args[i], signature.args[i], types.int64) for i in (1, 2, 3))
        top_ = args[4]
        start = builder.mul(builder.add(builder.mul(h_, sg), g_), sbs)
        whole = builder.and_(n_, ir.Constant(i64, -16))
        best = cgutils.alloca_once_value(builder, _splat_value(builder, top_))
        with cgutils.for_range_slice(builder, ir.Constant(i64, 0), whole, ir.Constant(i64, 16)) as (t, _):
            x = builder.load(builder.bitcast(builder.gep(sa.data, [builder.add(start, t)]), vec.as_pointer()), align=4)
            acc = builder.load(best)
            builder.store(builder.select(builder.fcmp_ordered(">", x, acc), x, acc), best)
        out = cgutils.alloca_once_value(builder, builder.extract_element(builder.load(best), _i32(0)))

        def keep_greater(x):
            cur = builder.load(out)
            builder.store(builder.select(builder.fcmp_ordered(">", x, cur), x, cur), out)

        lanes = builder.load(best)
        for lane in range(1, 16):
            keep_greater(builder.extract_element(lanes, _i32(lane)))
        with cgutils.for_range_slice(builder, whole, n_, ir.Constant(i64, 1)) as (t, _):
            keep_greater(builder.load(builder.gep(sa.data, [builder.add(start, t)])))
        return builder.load(out)

    return types.float32(scores, h, g, n, top), codegen


_SCORE_PAD = 16
"""Floats after each query head's row of a block's scores, so that the rows, BS floats apart (BS = 256: 1 KiB), do
not all fall in the same few sets of the L1 cache (Llama-3.2-1B's 32 rows: 4 sets of 8 ways, every one)."""
_VALUE_KEYS = 4
"""Keys a value tile (_value_tile) sums into its accumulators before it stores them."""
_VALUE_GROUPS = 4
"""Query heads whose 64 output channels a value tile keeps in registers at once (4 x 4 <16 x float>)."""


_PREFETCH_ROWS = 8
"""Rows ahead of a tile that it prefetches, the same heads and channels (the tiles read a block out of address
order, which the hardware's stream prefetchers do not follow)."""


@intrinsic
def _prefetch_rows(typingctx, block, t, rows):
    """Prefetch rows t.. t + rows - 1 of block (BS, Hkv, D), C-contiguous, a line at a time in address order
    (rows: a literal); nothing past the block's last row."""
    if not (_contiguous(block) and isinstance(rows, types.IntegerLiteral)):
        return None
    n = rows.literal_value

    def codegen(context, builder, signature, args):
        ba = context.make_array(signature.args[0])(context, builder, args[0])
        bs, hh, dd = cgutils.unpack_tuple(builder, ba.shape, 3)
        t_ = args[1]
        inside = builder.icmp_signed("<=", builder.add(t_, ir.Constant(ir.IntType(64), n)), bs)
        with builder.if_then(inside, likely=True):
            per_row = builder.mul(hh, dd)
            start = builder.mul(t_, per_row)
            itemsize = context.get_abi_sizeof(context.get_data_type(signature.args[0].dtype))
            i64 = ir.IntType(64)
            first = builder.ptrtoint(builder.gep(ba.data, [start]), i64)
            prefetch_lines(builder, first, builder.mul(builder.mul(per_row, ir.Constant(i64, n)), ir.Constant(i64, itemsize)))
        return context.get_dummy_value()

    return types.void(block, t, rows), codegen


@intrinsic
def _prefetch_ahead(typingctx, block, t, rows):
    """Prefetch rows t.. t + rows - 1 of block (BS, Hkv, D), C-contiguous, into the L2 cache (locality 2), a line
    at a time; nothing past the block's last row. The kernel's passes prefetch the block the next pass reads:
    the scores pass the same block's values, the values pass the next block's keys (_attend_range)."""
    if not (_contiguous(block) and isinstance(t, types.Integer) and isinstance(rows, types.Integer)):
        return None

    def codegen(context, builder, signature, args):
        i64 = ir.IntType(64)
        ba = context.make_array(signature.args[0])(context, builder, args[0])
        bs, hh, dd = cgutils.unpack_tuple(builder, ba.shape, 3)
        t_, n_ = (context.cast(builder, args[i], signature.args[i], types.int64) for i in (1, 2))
        end = builder.select(builder.icmp_signed("<", builder.add(t_, n_), bs), builder.add(t_, n_), bs)
        with builder.if_then(builder.icmp_signed("<", t_, end), likely=True):
            per_row = builder.mul(hh, dd)
            itemsize = ir.Constant(i64, context.get_abi_sizeof(context.get_data_type(signature.args[0].dtype)))
            first = builder.ptrtoint(builder.gep(ba.data, [builder.mul(t_, per_row)]), i64)
            prefetch_lines(builder, first, builder.mul(builder.mul(per_row, builder.sub(end, t_)), itemsize), locality=2)
        return context.get_dummy_value()

    return types.void(block, t, rows), codegen


def _contiguous(*arrays) -> bool:
    return all(isinstance(a, types.Array) and a.ndim == 3 and a.layout == "C" for a in arrays)


@intrinsic
def _value_tile(typingctx, acc, h, d0, vb, t0, scores, groups):
    """acc[h, g, d0:d0 + 64] += sum over i < _VALUE_KEYS of scores[h, g, t0 + i] * vb[t0 + i, h, d0:d0 + 64], for
    every query head g of KV head h (groups: head_shape_tag's (0,) * G). The 64 channels of _VALUE_GROUPS
    query heads stay in registers over the tile's keys, and each value row is loaded and widened once for
    them (the key-by-key loop widens it once per query head and loads and stores the sums per key)."""
    if not (isinstance(groups, types.UniTuple) and _contiguous(acc, vb, scores) and acc.dtype == types.float32
            and scores.dtype == types.float32 and vb.dtype in (types.float32, types.uint16, types.int16)):
        return None
    G = groups.count
    i64 = ir.IntType(64)
    f32 = ir.VectorType(ir.FloatType(), 16)

    def codegen(context, builder, signature, args):
        c = lambda x: ir.Constant(i64, x)  # noqa: E731
        aa, va, sa = (context.make_array(signature.args[i])(context, builder, args[i]) for i in (0, 3, 5))
        dv = cgutils.unpack_tuple(builder, aa.shape, 3)[2]
        vh, vd = cgutils.unpack_tuple(builder, va.shape, 3)[1:]
        bs = cgutils.unpack_tuple(builder, sa.shape, 3)[2]
        h_, d0_, t0_ = args[1], args[2], args[4]
        for g0 in range(0, G, _VALUE_GROUPS):
            gs = range(g0, min(G, g0 + _VALUE_GROUPS))
            head = {g: builder.add(builder.mul(h_, c(G)), c(g)) for g in gs}  # h * G + g
            at = {(g, ch): builder.add(builder.mul(head[g], dv), builder.add(d0_, c(16 * ch))) for g in gs for ch in range(4)}
            ptrs = {key: builder.bitcast(builder.gep(aa.data, [at[key]]), f32.as_pointer()) for key in at}
            sums = {key: builder.load(ptr, align=4) for key, ptr in ptrs.items()}
            for i in range(_VALUE_KEYS):
                t = builder.add(t0_, c(i))
                row = builder.add(builder.mul(builder.add(builder.mul(t, vh), h_), vd), d0_)
                kind = signature.args[3].dtype
                values = [_vector_of(builder, context, kind, builder.gep(va.data, [builder.add(row, c(16 * ch))]))
                          for ch in range(4)]
                for g in gs:
                    p = builder.load(builder.gep(sa.data, [builder.add(builder.mul(head[g], bs), t)]))
                    weight = _splat_value(builder, p)
                    for ch in range(4):
                        sums[g, ch] = builder.fadd(sums[g, ch], builder.fmul(weight, values[ch], flags=("contract",)),
                                                   flags=("contract",))
            for key, ptr in ptrs.items():
                builder.store(sums[key], ptr, align=4)
        return context.get_dummy_value()

    return types.void(acc, h, d0, vb, t0, scores, groups), codegen


@njit(cache=True, fastmath=_FASTMATH, inline="always")
def _values_by_keys(vb, v, v_scales, blk, visible, scores, acc, lsum, dv, t0, t1):  # pragma: no cover - compiled
    """_block_values key by key over keys t0..t1-1: acc[h, g, :dv] += p * value scale * value, lsum[h, g] += p."""
    H, G = acc.shape[0], acc.shape[1]
    for t in range(t0, t1):
        if not visible[t]:
            continue
        for h in range(H):
            for g in range(G):
                p = scores[h, g, t]
                lsum[h, g] += p
                for d in range(dv):
                    acc[h, g, d] += p * _wide(vb[t, h, d])


def _block_values(vb, v, v_scales, blk, visible, scores, acc, lsum, dv, groups, ahead):  # pragma: no cover - its overload
    raise NotImplementedError


@overload(_block_values, jit_options={"fastmath": _FASTMATH})
def _block_values_impl(vb, v, v_scales, blk, visible, scores, acc, lsum, dv, groups, ahead):
    """acc[h, g] += p * value and lsum[h, g] += p for every visible key of block vb, p = scores[h, g, t] (the
    exps). By tiles of _VALUE_KEYS keys (_value_tile) where groups is a constant and the blocks float16,
    bfloat16, float32 or fp8 (vb then _block's dequantized float32 scratch), over the tiles whose keys are all
    visible (a hidden slot may hold NaN, which 0 * NaN would carry in); the other keys key by key."""
    tiled = (isinstance(groups, types.UniTuple) and groups.count > 0
             and v.dtype in (types.float32, types.uint16, types.int16, types.uint8))

    def by_tiles(vb, v, v_scales, blk, visible, scores, acc, lsum, dv, groups, ahead):
        H, G, BS = scores.shape[0], scores.shape[1], vb.shape[0]
        T = _VALUE_KEYS
        for t0 in range(0, BS, T):
            whole = t0 + T <= BS and dv % 64 == 0  # (head_shape_tag gives groups only where dv % 64 == 0)
            for t in range(t0, min(t0 + T, BS)):
                whole = whole and visible[t]
            if not whole:  # one call site: the inlined key-by-key loop compiled once
                _values_by_keys(vb, v, v_scales, blk, visible, scores, acc, lsum, dv, t0, min(t0 + T, BS))
                continue
            _prefetch_rows(vb, t0 + _PREFETCH_ROWS, _VALUE_KEYS)
            _prefetch_ahead(ahead, t0, T)
            for h in range(H):
                for d0 in range(0, dv, 64):
                    _value_tile(acc, h, d0, vb, t0, scores, groups)
                for g in range(G):
                    total = np.float32(0.0)
                    for t in range(t0, t0 + T):
                        total += scores[h, g, t]
                    lsum[h, g] += total

    def by_keys(vb, v, v_scales, blk, visible, scores, acc, lsum, dv, groups, ahead):
        _values_by_keys(vb, v, v_scales, blk, visible, scores, acc, lsum, dv, 0, vb.shape[0])

    return by_tiles if tiled else by_keys


def _tile_steps(heads, groups):  # pragma: no cover - replaced by its overload inside compiled code
    raise NotImplementedError


@overload(_tile_steps)
def _tile_steps_impl(heads, groups):
    """tile_shape of head_shape_tag's tuples, as constants of the compiled code."""
    tiled = isinstance(heads, types.UniTuple) and isinstance(groups, types.UniTuple)
    steps = tile_shape(heads.count, groups.count) if tiled else (1, 1)
    return lambda heads, groups: steps


def head_shape_tag(heads: int, group: int, head_dim: int = 64, dv: int = 64) -> tuple:
    """The kernels' `heads` and `groups` arguments: (0,) * heads and (0,) * group, the KV heads and the
    query heads of a KV head as constants of the compiled code, where the value tiles (_value_tile: dv a
    multiple of 64) and the score tiles (tile_shape: head dim 64, float16) take them: a key row's query
    heads at most _TILE_SUMS; else ((), ()). Llama-3.2-1B's 8 x 4 heads take neither: score tiles of 4 KV
    heads (session 16) or of 4 keys x 1 KV head took 1.0-1.2x the time; value tiles 1.03-1.15x, and with the padded
    scores (_SCORE_PAD) 0.79x main's time against 0.71x without them (docs/bench_kernels.md, "Session 17").

    >>> head_shape_tag(3, 3), head_shape_tag(1, 4, 256, 256)[1], head_shape_tag(8, 4), head_shape_tag(2, 3, 16, 16)
    (((0, 0, 0), (0, 0, 0)), (0, 0, 0, 0), ((), ()), ((), ()))
    """
    tiles = heads * group <= _TILE_SUMS and dv % 64 == 0
    return ((0,) * heads, (0,) * group) if tiles else ((), ())


def _block_scores(q, r, kb, k, k_scales, blk, visible, scores, sc, dims, heads, groups, ahead):  # pragma: no cover - its overload
    raise NotImplementedError


@overload(_block_scores)
def _block_scores_impl(q, r, kb, k, k_scales, blk, visible, scores, sc, dims, heads, groups, ahead):
    """scores[h, g, t] of block kb for query row r: sc * (q . key), -inf where a key is not
    visible. By tiles (_score_tile) where the head dim and the heads are constants (dims, heads and
    groups not empty) and the blocks float16 or fp8 (kb then _block's dequantized float32 scratch, in cache;
    with the value tiles, SmolLM2's fp8 blocks took 0.78-0.84x the time, session 19); else key by key, head by
    head. SmolLM2's heads, 4096 keys, one thread, alternated with the key-by-key loops under load
    (docs/bench_kernels.md, "Session 16"): the tiles took 0.80-0.89x the time in cache with every dtype,
    but streamed from memory (the engine's case) float16 0.80-0.95x, float32 1.02-1.04x and bfloat16
    1.12-1.15x: of those only float16 uses them."""
    tiled = (all(isinstance(x, types.UniTuple) and x.count > 0 for x in (dims, heads, groups))
             and k.dtype in (types.int16, types.uint8) and heads.count * groups.count <= _TILE_SUMS)  # measured below

    def by_tiles(q, r, kb, k, k_scales, blk, visible, scores, sc, dims, heads, groups, ahead):
        H, G, BS = scores.shape[0], scores.shape[1], kb.shape[0]
        T, HT = _tile_steps(heads, groups)
        for t0 in range(0, BS - BS % T, T):
            _prefetch_ahead(ahead, t0, T)
            for h0 in range(0, H, HT):
                _score_tile(q, r, kb, t0, h0, scores, sc, dims, heads, groups)
        for t in range(BS - BS % T, BS):
            for h in range(H):
                for g in range(G):
                    x = np.float32(0.0)
                    for d in range(16 * len(dims)):
                        x += q[r, h, g, d] * _wide(kb[t, h, d])
                    scores[h, g, t] = x * sc
        for t in range(BS):
            if not visible[t]:  # its slot may hold anything (NaN): its scores are -inf whatever was summed
                for h in range(H):
                    for g in range(G):
                        scores[h, g, t] = -np.inf

    def by_keys(q, r, kb, k, k_scales, blk, visible, scores, sc, dims, heads, groups, ahead):
        H, G, BS = scores.shape[0], scores.shape[1], kb.shape[0]
        D = 16 * len(dims) if len(dims) > 0 else q.shape[3]
        for t in range(BS):
            if not visible[t]:
                for h in range(H):
                    for g in range(G):
                        scores[h, g, t] = -np.inf
                continue
            for h in range(H):
                for g in range(G):
                    x = np.float32(0.0)
                    for d in range(D):
                        x += q[r, h, g, d] * _wide(kb[t, h, d])
                    scores[h, g, t] = x * sc

    return by_tiles if tiled else by_keys

# exp(x) for x <= 0 in float32 operations only, so that a block's exps vectorize (numba's math.exp is
# one libm call per value: about 6 ns, against 0.85 ns here, measured on this project's machine):
# cephes' expf, x = k ln2 + r (ln2 in two parts), a degree-6 polynomial in r, times 2**k built in the
# float's exponent bits. Within 1.3 ulp of float64's exp (libm: 1 ulp); 0 below -87 (libm: 0 or a
# subnormal, nothing beside the block's maximum, whose exp is 1); NaN stays NaN.
_LOG2E = np.float32(1.4426950408889634)
_LN2_HI = np.float32(0.693359375)
_LN2_LO = np.float32(-2.12194440e-4)
_EXP_MIN = np.float32(-87.0)


@njit(cache=True, fastmath={"contract"})  # no reassociation: it would merge the two parts of ln2
def _exp_shifted(x, shift, bits):  # pragma: no cover - compiled
    """x[i] = exp(x[i] - shift) in place, for x (n,) float32 whose values are <= shift (or NaN, or
    -inf: 0); bits: int32 scratch (n,)."""
    two_k = bits.view(np.float32)
    for i in range(x.shape[0]):
        a = x[i] - shift
        k = np.floor(a * _LOG2E + np.float32(0.5))
        r = a - k * _LN2_HI
        r = r - k * _LN2_LO
        p = np.float32(1.9875691500e-4)
        p = p * r + np.float32(1.3981999507e-3)
        p = p * r + np.float32(8.3334519073e-3)
        p = p * r + np.float32(4.1665795894e-2)
        p = p * r + np.float32(1.6666665459e-1)
        p = p * r + np.float32(5.0000001201e-1)
        keep = not (a < _EXP_MIN)  # NaN keeps its NaN
        x[i] = p * r * r + r + np.float32(1.0) if keep else np.float32(0.0)
        k = k if k > np.float32(-126.0) else np.float32(-126.0)
        bits[i] = np.int32((k + np.float32(127.0)) * np.float32(8388608.0)) if keep else np.int32(0)  # 2**k's bits
    for i in range(x.shape[0]):
        x[i] *= two_k[i]


@njit(cache=True, fastmath=_FASTMATH)
def _attend_range(w, q, k, v, k_scales, v_scales, dv, scale, table, kv_pos, row_seq, q_pos, window,  # pragma: no cover - compiled
                  splits,
                  out,
                  m_out,
                  l_out,
                  dims, heads, groups):
    """Work item w = r * splits + sp of attend_parallel: query row r over its sp-th range of blocks.

    Block by block, in three passes: every query head's scores against the block's visible keys
    (key by key, as the block lies in memory); per head, the block's maximum (the running maximum,
    and what was summed against it, rescaled once per block when it grows) and every score's exp in
    one vectorized pass (_exp_shifted); then the values, key by key, summed with those weights.
    Against one pass with an exp per score (libm's) this took 0.78-0.87x the time (30 layers of
    4096 keys, SmolLM2's heads, one thread, alternated in one process). With several KV heads, each pass
    prefetches the block the next one reads into L2 (_prefetch_ahead: the scores pass this block's values, the
    values pass the next block's keys): SmolLM2's float16 blocks from memory 0.81-0.85x the time on this project's
    Intel Xeon (Gemma 3's one KV head: 1.00-1.13x, so not there; docs/bench_weights.md, "Session 21")."""
    H, G, D = q.shape[1], q.shape[2], q.shape[3]
    if len(dims) > 0:  # a constant of the compilation: D == dv == 16 * len(dims) (head_dim_tag)
        D = 16 * len(dims)
        dv = D
    sc = np.float32(scale)  # scores scaled in float32: 0.89-0.92x the time of a float64 product per score
    BS = k.shape[1]
    nb = table.shape[1]
    per = (nb + splits - 1) // splits
    r = w // splits
    sp = w % splits
    b = row_seq[r]
    qp = q_pos[r]
    acc = np.zeros((H, G, dv), dtype=np.float32)
    m = np.full((H, G), -np.inf, dtype=np.float32)
    lsum = np.zeros((H, G), dtype=np.float32)
    scores = np.empty((H, G, BS + _SCORE_PAD), dtype=np.float32)  # a block's scores, then their exps (rows padded)
    bits = np.empty(BS, dtype=np.int32)
    visible = np.empty(BS, dtype=np.bool_)
    j0 = sp * per
    j1 = min(nb, j0 + per)
    k_scratch = _scratch(k, D)
    v_scratch = _scratch(v, dv)
    for j in range(j0, j1):
        blk = table[b, j]
        seen = 0
        for t in range(BS):
            kp = kv_pos[b, j * BS + t]
            visible[t] = kp <= qp and not (window > 0 and qp - kp >= window)
            seen += visible[t]
        if seen == 0:
            continue
        kb = _block(k, k_scales, blk, D, k_scratch)
        vb = _block(v, v_scales, blk, dv, v_scratch)
        ahead = H > 1  # prefetch the next pass's block (_prefetch_ahead): measured with several KV heads only
        _block_scores(q, r, kb, k, k_scales, blk, visible, scores, sc, dims, heads, groups, v[blk, :BS if ahead else 0])
        for h in range(H):
            for g in range(G):
                top = _row_max(scores, h, g, BS, m[h, g])
                if top > m[h, g]:  # a new max: rescale what was summed against the old one
                    c = np.float32(math.exp(m[h, g] - top))
                    lsum[h, g] *= c
                    for d in range(dv):
                        acc[h, g, d] *= c
                    m[h, g] = top
                _exp_shifted(scores[h, g, :BS], m[h, g], bits)
        _block_values(vb, v, v_scales, blk, visible, scores, acc, lsum, dv, groups,
                      k[table[b, j + 1] if j + 1 < j1 else blk, :BS if ahead and j + 1 < j1 else 0])
    for h in range(H):
        for g in range(G):
            m_out[r, sp, h, g] = m[h, g]
            l_out[r, sp, h, g] = lsum[h, g]
            for d in range(dv):
                out[r, sp, h, g, d] = acc[h, g, d]


@njit(cache=True, inline="always")
def _range_states(q, splits, dv):  # pragma: no cover - compiled
    """Scratch for each (query row, block range)'s state: out (R, splits, Hkv, G, dv), max and sum (R, splits, Hkv, G)."""
    R, H, G = q.shape[0], q.shape[1], q.shape[2]
    return (np.empty((R, splits, H, G, dv), dtype=np.float32), np.empty((R, splits, H, G), dtype=np.float32),
            np.empty((R, splits, H, G), dtype=np.float32))


@njit(parallel=True, cache=True, fastmath=_FASTMATH)
def attend_parallel(q, k, v, k_scales, v_scales, dv, scale, table, kv_pos, row_seq, q_pos, window,  # pragma: no cover - compiled
                    splits,
                    out,
                    lse,
                    dims, heads, groups):
    """Every query row's attention state: its `splits` ranges of blocks in parallel, then merged.

    q: (R, Hkv, G, D) float32 C-contiguous, the query rows (not scaled).
    k: (NB, BS, Hkv, D) float32 C-contiguous, every block of the layer; v: (NB, BS, Hkv, Dv_stored),
        the value blocks (may be k itself, of which the first dv channels are the values). Or both
        the bit patterns of 16-bit blocks: uint16 for bfloat16, int16 for float16; or of fp8 e4m3
        blocks: uint8.
    k_scales, v_scales: float32 (NB, BS, Hkv) the scale of each key / value of fp8 blocks (NO_SCALES
        for other dtypes; v_scales is k_scales when v is k).
    dv: value channels; scale: softmax scale.
    table: int64 (B, nb) block ids; kv_pos: int64 (B, nb * BS) position of every slot;
    row_seq: int64 (R,) the table row of each query row; q_pos: int64 (R,) its position.
    window: > 0: a key is visible iff 0 <= q_pos - kv_pos < window; 0: iff kv_pos <= q_pos.
    splits: block ranges per row (flash-decoding); dims: head_dim_tag(D, dv) (() always works).
    Writes out (R, Hkv, G, dv) float32, normalized, and lse (R, Hkv, G) float32 (merge_splits: 0
    and -inf for a row that sees no key).
    """
    out_p, m_p, l_p = _range_states(q, splits, dv)
    for w in prange(q.shape[0] * splits):
        # int64 as attend_serial passes it: prange's index is unsigned, which compiled a second _attend_range
        _attend_range(np.int64(w), q, k, v, k_scales, v_scales, dv, scale, table, kv_pos, row_seq, q_pos, window, splits,
                      out_p, m_p, l_p, dims, heads, groups)
    merge_splits(out_p, m_p, l_p, out, lse)


@njit(cache=True, fastmath=_FASTMATH)
def attend_serial(q, k, v, k_scales, v_scales, dv, scale, table, kv_pos, row_seq, q_pos, window,  # pragma: no cover - compiled
                  splits,
                  out,
                  lse,
                  dims, heads, groups):
    """attend_parallel on the calling thread alone: no thread pool is started (a rank running with
    one torch thread, several ranks on one host, then has no second pool spinning beside torch's)."""
    out_p, m_p, l_p = _range_states(q, splits, dv)
    for w in range(q.shape[0] * splits):
        _attend_range(w, q, k, v, k_scales, v_scales, dv, scale, table, kv_pos, row_seq, q_pos, window, splits, out_p, m_p, l_p,
                      dims, heads, groups)
    merge_splits(out_p, m_p, l_p, out, lse)


@njit(cache=True)
def merge_splits(out_p, m_p, l_p, out, lse):  # pragma: no cover - compiled
    """Merge the block ranges' states of each row: out_p (R, S, Hkv, G, dv), m_p and l_p
    (R, S, Hkv, G) -> out (R, Hkv, G, dv) normalized and lse (R, Hkv, G) = max + log(sum); a row
    that saw no key gets out = 0, lse = -inf; a row whose sums are NaN (a NaN score: NaN or inf in
    its query or a key) gets NaN, so that non-finite inputs never turn into a finite output."""
    R, S, H, G, dv = out_p.shape
    for r in range(R):
        for h in range(H):
            for g in range(G):
                mx = -np.inf
                poisoned = False
                for sp in range(S):
                    mx = max(mx, m_p[r, sp, h, g])
                    poisoned = poisoned or l_p[r, sp, h, g] != l_p[r, sp, h, g]
                if poisoned:  # a NaN score (NaN or inf in q or k) made a sum NaN: the row is NaN, never "saw no key"
                    lse[r, h, g] = np.nan
                    for d in range(dv):
                        out[r, h, g, d] = np.nan
                    continue
                if mx == -np.inf:
                    lse[r, h, g] = -np.inf
                    for d in range(dv):
                        out[r, h, g, d] = 0.0
                    continue
                total = 0.0
                for d in range(dv):
                    out[r, h, g, d] = 0.0
                for sp in range(S):
                    if m_p[r, sp, h, g] == -np.inf:
                        continue
                    wgt = math.exp(m_p[r, sp, h, g] - mx)
                    total += l_p[r, sp, h, g] * wgt
                    for d in range(dv):
                        out[r, h, g, d] += out_p[r, sp, h, g, d] * wgt
                for d in range(dv):
                    out[r, h, g, d] /= total
                lse[r, h, g] = mx + math.log(total)
