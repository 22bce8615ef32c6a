"""16-key tiles of the CPU paged decode kernel (treeattn.ops.paged_cpu_kernel), written in LLVM IR.

    _tile_dots(q, q_off, k, k_off, k_stride, width, out, out_off)      # 16 scores of one query head
    _tile_values(p, p_off, v, v_off, v_stride, width, acc, acc_off)    # 16 weighted value rows summed

numba's own loops compute a score as one dot product over the head dim: 4 vector multiply-adds and a
horizontal sum of ~10 shuffles and adds per score, and add a value row into an accumulator that lives
in memory (a load and a store per 16 channels per key). Here 16 keys are taken at once: the dot
products keep 16 accumulators of 16 lanes and end with one 16 x 16 transpose-and-add (30 shuffles and
15 adds for 16 scores); the values keep each 16-channel slice of the accumulator in a register across
the 16 keys. The vectors are LLVM's <16 x float>, which LLVM lowers to the host's registers (one
AVX-512 register, two AVX2 ones, four SSE ones), so the tiles run on every x86 or ARM host.

Stored elements are widened in registers, exactly: float32 as it is, bfloat16 (uint16 bits) by a
shift into a float32's high half, float16 (int16 bits) by fpext (F16C's vcvtph2ps) where the CPU has
F16C, else by integer operations (half_bits_in_integers). Sums are float32 in a fixed order: a
value slice adds its 16 keys in key order (as one key at a time did); a score sums 16 lanes of
partial products and then the lanes pairwise (a different order than one key at a time: float32
rounding, within the kernel's tolerance). The kernel uses the tiles where all 16 keys of a tile are
visible and the widths and block size are multiples of 16 (tileable says which arrays qualify).
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic, overload

LANES = 16
_F32 = ir.FloatType()
_I32 = ir.IntType(32)
_I64 = ir.IntType(64)
_CONTRACT = ("contract",)


def has_f16c(context) -> bool:
    """Whether numba compiles for a CPU with F16C (its target features; NUMBA_CPU_NAME=generic: none)."""
    return "+f16c" in str(getattr(context.codegen(), "_tm_features", ""))


def _const(ty, value, lanes):
    """A constant of type ty, or a vector of `lanes` of them (lanes 0: a scalar)."""
    return ir.Constant(ty, value) if lanes == 0 else ir.Constant(ir.VectorType(ty, lanes), [value] * lanes)


def half_bits_in_integers(builder, bits, lanes=0):
    """float16 bits (i16, or a vector of `lanes` of them) -> float32 without the CPU's conversion:
    exponent and mantissa moved into a float32's place, the sign on top, times 2**112 (float16's
    exponent bias -> float32's; it normalizes subnormals too), exact; exponent 31 keeps its mantissa
    under an all-ones float32 exponent (infinities, NaNs)."""
    i32 = _I32 if lanes == 0 else ir.VectorType(_I32, lanes)
    f32 = _F32 if lanes == 0 else ir.VectorType(_F32, lanes)
    code = builder.zext(bits, i32)
    magnitude = builder.and_(code, _const(_I32, 0x7FFF, lanes))
    placed = builder.or_(builder.shl(magnitude, _const(_I32, 13, lanes)),
                         builder.shl(builder.and_(code, _const(_I32, 0x8000, lanes)), _const(_I32, 16, lanes)))
    value = builder.fmul(builder.bitcast(placed, f32), _const(_F32, 2.0**112, lanes))
    special = builder.bitcast(builder.or_(placed, _const(_I32, 0x7F800000, lanes)), f32)
    return builder.select(builder.icmp_unsigned(">=", magnitude, _const(_I32, 0x7C00, lanes)), special, value)


def _widen(context, builder, vec, dtype, integers=False):
    """A <16 x stored element> vector as <16 x float>, exactly (see the module's docstring)."""
    f32v = ir.VectorType(_F32, LANES)
    if dtype == types.float32:
        return vec
    if dtype == types.uint16:
        return builder.bitcast(builder.shl(builder.zext(vec, ir.VectorType(_I32, LANES)), _const(_I32, 16, LANES)), f32v)
    if has_f16c(context) and not integers:
        return builder.fpext(builder.bitcast(vec, ir.VectorType(ir.HalfType(), LANES)), f32v)
    return half_bits_in_integers(builder, vec, LANES)


_ELEMENT = {types.float32: _F32, types.uint16: ir.IntType(16), types.int16: ir.IntType(16)}


def _base(context, builder, arrty, arr, offset, offty):
    """A pointer to element `offset` of a C-contiguous array's data."""
    data = context.make_array(arrty)(context, builder, arr).data
    return builder.gep(data, [context.cast(builder, offset, offty, types.intp)])


def _load(builder, base, offset, element):
    """<16 x element> at element `offset` (an i64) of the pointer `base` (unaligned)."""
    ptr = builder.bitcast(builder.gep(base, [offset]), ir.VectorType(element, LANES).as_pointer())
    return builder.load(ptr, align=1)


def _transpose_sum(builder, vecs):
    """[sum of the lanes of v for v in vecs] as one vector, for 16 vectors of 16 lanes: pairs of
    vectors are folded into one, the first halves of each source's lanes plus the second halves,
    until every source is one lane (4 rounds; the sources stay in order)."""
    group = LANES
    while len(vecs) > 1:
        half = group // 2
        lo, hi = [], []
        for side in (0, LANES):
            for src in range(LANES // group):
                lo += [side + src * group + i for i in range(half)]
                hi += [side + src * group + half + i for i in range(half)]
        mask = lambda idx: ir.Constant(ir.VectorType(_I32, LANES), idx)  # noqa: E731
        vecs = [builder.fadd(builder.shuffle_vector(x, y, mask(lo)), builder.shuffle_vector(x, y, mask(hi)))
                for x, y in zip(vecs[0::2], vecs[1::2])]
        group = half
    return vecs[0]


_GROUP = 4  # 16-channel chunks per pass over a tile's rows: 64 channels, the head dims of most models


def _loop_chunks(builder, width, body):
    """body(col, chunks) over the channels: passes of _GROUP chunks while they last, then single chunks."""
    groups = builder.udiv(width, ir.Constant(_I64, LANES * _GROUP))
    with cgutils.for_range(builder, groups) as loop:
        body(builder.mul(loop.index, ir.Constant(_I64, LANES * _GROUP)), _GROUP)
    done = builder.mul(groups, ir.Constant(_I64, _GROUP))
    with cgutils.for_range_slice(builder, done, builder.udiv(width, ir.Constant(_I64, LANES)), ir.Constant(_I64, 1), inc=True) as (c, _):
        body(builder.mul(c, ir.Constant(_I64, LANES)), 1)


def _rows(builder, base, col, stride):
    """Pointers to column `col` of the tile's 16 rows, each one stride past the last."""
    ptr = builder.gep(base, [col])
    out = [ptr]
    for _ in range(LANES - 1):
        ptr = builder.gep(ptr, [stride])
        out.append(ptr)
    return out


def _tile_dots_codegen(integers):
    def typer(typingctx, q, q_off, k, k_off, k_stride, width, out, out_off):
        if k.dtype not in _ELEMENT or q.dtype != types.float32 or out.dtype != types.float32:
            return None
        sig = types.none(q, q_off, k, k_off, k_stride, width, out, out_off)

        def codegen(context, builder, signature, args):
            a = signature.args
            qp = _base(context, builder, a[0], args[0], args[1], a[1])
            kp = _base(context, builder, a[2], args[2], args[3], a[3])
            stride = context.cast(builder, args[4], a[4], types.intp)
            width = context.cast(builder, args[5], a[5], types.intp)
            f32v = ir.VectorType(_F32, LANES)
            element, dtype = _ELEMENT[a[2].dtype], a[2].dtype
            accs = [cgutils.alloca_once_value(builder, ir.Constant(f32v, None)) for _ in range(LANES)]

            def body(col, chunks):
                qv = [_load(builder, qp, builder.add(col, ir.Constant(_I64, LANES * c)), _F32) for c in range(chunks)]
                for acc, row in zip(accs, _rows(builder, kp, col, stride)):
                    total = builder.load(acc)
                    for c in range(chunks):
                        kv = _widen(context, builder, _load(builder, row, ir.Constant(_I64, LANES * c), element), dtype, integers)
                        total = builder.fadd(total, builder.fmul(qv[c], kv, flags=_CONTRACT), flags=_CONTRACT)
                    builder.store(total, acc)

            _loop_chunks(builder, width, body)
            total = _transpose_sum(builder, [builder.load(acc) for acc in accs])
            op = _base(context, builder, a[6], args[6], args[7], a[7])
            builder.store(total, builder.bitcast(op, f32v.as_pointer()), align=1)
            return context.get_dummy_value()

        return sig, codegen

    return typer


_tile_dots = intrinsic(_tile_dots_codegen(False))
"""out.flat[out_off + i] = sum over d < width of q.flat[q_off + d] * k.flat[k_off + i * k_stride + d],
for the 16 keys i < 16 (float32 q and out; k float32, or bfloat16 / float16 bits; width % 16 == 0)."""
_tile_dots_half_in_integers = intrinsic(_tile_dots_codegen(True))
"""_tile_dots with float16 widened in integers whatever the CPU (the path of a CPU without F16C; its test)."""


@intrinsic
def _tile_values(typingctx, p, p_off, v, v_off, v_stride, width, acc, acc_off):
    """acc.flat[acc_off + d] += sum over i < 16, in order, of p.flat[p_off + i] * v.flat[v_off + i * v_stride + d]
    for d < width (float32 p and acc; v float32, or bfloat16 / float16 bits; width % 16 == 0)."""
    if v.dtype not in _ELEMENT or p.dtype != types.float32 or acc.dtype != types.float32:
        return None
    sig = types.none(p, p_off, v, v_off, v_stride, width, acc, acc_off)

    def codegen(context, builder, signature, args):
        a = signature.args
        pp = _base(context, builder, a[0], args[0], args[1], a[1])
        vp = _base(context, builder, a[2], args[2], args[3], a[3])
        ap = _base(context, builder, a[6], args[6], args[7], a[7])
        stride = context.cast(builder, args[4], a[4], types.intp)
        width = context.cast(builder, args[5], a[5], types.intp)
        f32v = ir.VectorType(_F32, LANES)
        element, dtype = _ELEMENT[a[2].dtype], a[2].dtype
        zeros = ir.Constant(ir.VectorType(_I32, LANES), [0] * LANES)
        weights = []
        for i in range(LANES):
            one = builder.insert_element(ir.Constant(f32v, ir.Undefined), builder.load(builder.gep(pp, [ir.Constant(_I64, i)])),
                                         ir.Constant(_I32, 0))
            weights.append(builder.shuffle_vector(one, ir.Constant(f32v, ir.Undefined), zeros))

        def body(col, chunks):
            targets = [builder.bitcast(builder.gep(ap, [builder.add(col, ir.Constant(_I64, LANES * c))]), f32v.as_pointer())
                       for c in range(chunks)]
            totals = [builder.load(t, align=1) for t in targets]
            for w, row in zip(weights, _rows(builder, vp, col, stride)):
                for c in range(chunks):
                    vv = _widen(context, builder, _load(builder, row, ir.Constant(_I64, LANES * c), element), dtype)
                    totals[c] = builder.fadd(totals[c], builder.fmul(w, vv, flags=_CONTRACT), flags=_CONTRACT)
            for t, total in zip(targets, totals):
                builder.store(total, t, align=1)

        _loop_chunks(builder, width, body)
        return context.get_dummy_value()

    return sig, codegen


def tileable(q, k, v):  # pragma: no cover - replaced by its overload inside compiled code
    raise NotImplementedError


@overload(tileable)
def tileable_impl(q, k, v):
    """Whether the tiles can read these arrays (C-contiguous float32 queries; float32, bfloat16 or
    float16 blocks): a constant of the compilation; fp8 blocks (uint8) keep the kernel's own loops."""
    ok = (k.dtype in _ELEMENT and v.dtype == k.dtype and q.dtype == types.float32
          and all(getattr(a, "layout", "") == "C" for a in (q, k, v)))
    return (lambda q, k, v: True) if ok else (lambda q, k, v: False)


def tile_dots(q, q_off, k, k_off, k_stride, width, out, out_off):  # pragma: no cover - replaced by its overload
    raise NotImplementedError


def tile_values(p, p_off, v, v_off, v_stride, width, acc, acc_off):  # pragma: no cover - replaced by its overload
    raise NotImplementedError


@overload(tile_dots)
def _tile_dots_impl(q, q_off, k, k_off, k_stride, width, out, out_off):
    """_tile_dots for the dtypes it reads; a no-op for the others (never called: tileable is False)."""
    if k.dtype in _ELEMENT:
        return lambda q, q_off, k, k_off, k_stride, width, out, out_off: _tile_dots(q, q_off, k, k_off, k_stride, width, out, out_off)
    return lambda q, q_off, k, k_off, k_stride, width, out, out_off: None


@overload(tile_values)
def _tile_values_impl(p, p_off, v, v_off, v_stride, width, acc, acc_off):
    """_tile_values for the dtypes it reads; a no-op for the others (never called: tileable is False)."""
    if v.dtype in _ELEMENT:
        return lambda p, p_off, v, v_off, v_stride, width, acc, acc_off: _tile_values(p, p_off, v, v_off, v_stride, width, acc, acc_off)
    return lambda p, p_off, v, v_off, v_stride, width, acc, acc_off: None


@intrinsic
def prefetch(typingctx, arr, off, count):
    """A hint to load elements off .. off + count - 1 of arr's data into the cache (llvm.prefetch, one per
    64-byte line; no fault, no effect on results): the tiles read 16 rows of all heads in a strided
    order that the hardware's own prefetcher follows less well than one key at a time."""
    sig = types.none(arr, off, count)

    def codegen(context, builder, signature, args):
        a = signature.args
        base = builder.bitcast(_base(context, builder, a[0], args[0], args[1], a[1]), ir.IntType(8).as_pointer())
        nbytes = builder.mul(context.cast(builder, args[2], a[2], types.intp), ir.Constant(_I64, context.get_abi_sizeof(context.get_data_type(a[0].dtype))))
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [ir.IntType(8).as_pointer(), _I32, _I32, _I32]),
                                            "llvm.prefetch.p0i8")
        with cgutils.for_range_slice(builder, ir.Constant(_I64, 0), nbytes, ir.Constant(_I64, 64), inc=True) as (i, _):
            builder.call(fn, [builder.gep(base, [i]), ir.Constant(_I32, 0), ir.Constant(_I32, 3), ir.Constant(_I32, 1)])
        return context.get_dummy_value()

    return sig, codegen
