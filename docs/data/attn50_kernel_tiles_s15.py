# Scratch variants of paged_cpu_kernel._attend_range measured in session 15 (attn50); see attn50_kernel_ab_s15.py.
"""Scratch: value-chunk intrinsic (N keys, accumulators in registers), key-major within the chunk."""
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

LANES = 16
_F32 = ir.FloatType()
_I32 = ir.IntType(32)
_I64 = ir.IntType(64)
_CONTRACT = ("contract",)
_ELEMENT = {types.float32: _F32, types.uint16: ir.IntType(16), types.int16: ir.IntType(16)}


def _const(ty, value, lanes):
    return ir.Constant(ty, value) if lanes == 0 else ir.Constant(ir.VectorType(ty, lanes), [value] * lanes)


def _widen(context, builder, vec, dtype):
    f32v = ir.VectorType(_F32, LANES)
    if dtype == types.float32:
        return vec
    if dtype == types.uint16:
        return builder.bitcast(builder.shl(builder.zext(vec, ir.VectorType(_I32, LANES)), _const(_I32, 16, LANES)), f32v)
    return builder.fpext(builder.bitcast(vec, ir.VectorType(ir.HalfType(), LANES)), f32v)


def _base(context, builder, arrty, arr, offset, offty):
    data = context.make_array(arrty)(context, builder, arr).data
    return builder.gep(data, [context.cast(builder, offset, offty, types.intp)])


def _load(builder, base, offset, element):
    ptr = builder.bitcast(builder.gep(base, [offset]), ir.VectorType(element, LANES).as_pointer())
    return builder.load(ptr, align=1)


def make_values(N, GROUP=4):
    @intrinsic
    def values(typingctx, p, p_off, v, v_off, v_stride, width, acc, acc_off):
        """acc[acc_off + d] += sum_{i<N} p[p_off + i] * v[v_off + i * v_stride + d], d < width (width % 16 == 0), keys in order."""
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
            rows = [vp]
            for i in range(N):
                one = builder.insert_element(ir.Constant(f32v, ir.Undefined), builder.load(builder.gep(pp, [ir.Constant(_I64, i)])), ir.Constant(_I32, 0))
                weights.append(builder.shuffle_vector(one, ir.Constant(f32v, ir.Undefined), zeros))
                if i:
                    rows.append(builder.gep(rows[-1], [stride]))

            def body(col, chunks):
                targets = [builder.bitcast(builder.gep(ap, [builder.add(col, ir.Constant(_I64, LANES * c))]), f32v.as_pointer()) for c in range(chunks)]
                totals = [builder.load(t, align=1) for t in targets]
                for w, row in zip(weights, rows):
                    rc = builder.gep(row, [col])
                    for c in range(chunks):
                        vv = _widen(context, builder, _load(builder, rc, ir.Constant(_I64, LANES * c), element), dtype)
                        totals[c] = builder.fadd(totals[c], builder.fmul(w, vv, flags=_CONTRACT), flags=_CONTRACT)
                for t, total in zip(targets, totals):
                    builder.store(total, t, align=1)

            groups = builder.udiv(width, ir.Constant(_I64, LANES * GROUP))
            with cgutils.for_range(builder, groups) as loop:
                body(builder.mul(loop.index, ir.Constant(_I64, LANES * GROUP)), GROUP)
            done = builder.mul(groups, ir.Constant(_I64, GROUP))
            with cgutils.for_range_slice(builder, done, builder.udiv(width, ir.Constant(_I64, LANES)), ir.Constant(_I64, 1), inc=True) as (c, _):
                body(builder.mul(c, ir.Constant(_I64, LANES)), 1)
            return context.get_dummy_value()

        return sig, codegen
    return values


@intrinsic
def dots_lanes(typingctx, q, q_off, groups, k, k_off, width, part, part_off):
    """For g < groups: part[part_off + g * 256 + l] = sum_c q[q_off + g * width + 16 c + l] * k[k_off + 16 c + l], l < 16
    (16 lanes of partial sums of each query head's dot product with one key row; width % 16 == 0)."""
    if k.dtype not in _ELEMENT or q.dtype != types.float32 or part.dtype != types.float32:
        return None
    sig = types.none(q, q_off, groups, k, k_off, width, part, part_off)

    def codegen(context, builder, signature, args):
        a = signature.args
        qp = _base(context, builder, a[0], args[0], args[1], a[1])
        kp = _base(context, builder, a[3], args[3], args[4], a[3 + 1])
        pp = _base(context, builder, a[6], args[6], args[7], a[7])
        groups = context.cast(builder, args[2], a[2], types.intp)
        width = context.cast(builder, args[5], a[5], types.intp)
        f32v = ir.VectorType(_F32, LANES)
        element, dtype = _ELEMENT[a[3].dtype], a[3].dtype
        chunks = builder.udiv(width, ir.Constant(_I64, LANES))
        with cgutils.for_range(builder, groups) as gl:
            total = cgutils.alloca_once_value(builder, ir.Constant(f32v, None))
            qg = builder.gep(qp, [builder.mul(gl.index, width)])
            with cgutils.for_range(builder, chunks) as cl:
                col = builder.mul(cl.index, ir.Constant(_I64, LANES))
                kv = _widen(context, builder, _load(builder, kp, col, element), dtype)
                qv = _load(builder, qg, col, _F32)
                builder.store(builder.fadd(builder.load(total), builder.fmul(qv, kv, flags=_CONTRACT), flags=_CONTRACT), total)
            dst = builder.gep(pp, [builder.mul(gl.index, ir.Constant(_I64, LANES * LANES))])
            builder.store(builder.load(total), builder.bitcast(dst, f32v.as_pointer()), align=1)
        return context.get_dummy_value()

    return sig, codegen


def _transpose_sum(builder, vecs):
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


@intrinsic
def lanes_sum16(typingctx, part, part_off, out, out_off):
    """out[out_off + i] = sum_l part[part_off + 16 i + l] for i < 16 (one 16 x 16 transpose-and-add)."""
    sig = types.none(part, part_off, out, out_off)

    def codegen(context, builder, signature, args):
        a = signature.args
        pp = _base(context, builder, a[0], args[0], args[1], a[1])
        op = _base(context, builder, a[2], args[2], args[3], a[3])
        vecs = [_load(builder, pp, ir.Constant(_I64, LANES * i), _F32) for i in range(LANES)]
        total = _transpose_sum(builder, vecs)
        builder.store(total, builder.bitcast(op, ir.VectorType(_F32, LANES).as_pointer()), align=1)
        return context.get_dummy_value()

    return sig, codegen
