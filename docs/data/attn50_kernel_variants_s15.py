# Scratch variants of paged_cpu_kernel._attend_range measured in session 15 (attn50); see attn50_kernel_ab_s15.py.
"""Variant kernels of paged_cpu_kernel._attend_range for A/B (scratch, not in-tree)."""
import math
import numpy as np
from numba import njit
from treeattn.ops.paged_cpu_kernel import _wide, _scale, _block, _scratch, _exp_shifted, _range_states, merge_splits, _FASTMATH

CH = 8  # keys per chunk of the value pass


@njit(cache=False, fastmath=_FASTMATH, inline="always")
def _softmax_block(scores, m, lsum, acc, bits, H, G, dv):
    for h in range(H):
        for g in range(G):
            top = m[h, g]
            for t in range(scores.shape[2]):
                if scores[h, g, t] > top:
                    top = scores[h, g, t]
            if top > m[h, g]:
                c = np.float32(math.exp(m[h, g] - top))
                lsum[h, g] *= c
                for d in range(dv):
                    acc[h, g, d] *= c
                m[h, g] = top
            _exp_shifted(scores[h, g], m[h, g], bits)


def make(values_chunked, scores_mode, DC=0, DVC=0, skip='', pf=0, N=4, d16=0, f32s=0, lh=0):
    import attn50_kernel_tiles_s15 as tiles
    vals = tiles.make_values(N)

    @njit(cache=False, fastmath=_FASTMATH)
    def _attend_range(w, q, k, v, k_scales, v_scales, dv, scale, table, kv_pos, row_seq, q_pos, window, splits, out, m_out, l_out):
        H, G, D = q.shape[1], q.shape[2], q.shape[3]
        if DC:
            D = DC
        if DVC:
            dv = DVC
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
        if skip:
            lsum[:] = 1.0
            m[:] = 0.0
        scores = np.empty((H, G, BS), dtype=np.float32)
        part = np.empty((H, G, BS, 16), dtype=np.float32)
        part16 = np.empty(H * G * 256, dtype=np.float32)
        bits = np.empty(BS, dtype=np.int32)
        visible = np.empty(BS, dtype=np.bool_)
        j0 = sp * per
        j1 = min(nb, j0 + per)
        k_scratch = _scratch(k, D)
        v_scratch = _scratch(v, dv)
        qr = q[r]
        for j in range(j0, j1):
            blk = table[b, j]
            seen = 0
            for t in range(BS):
                kp = kv_pos[b, j * BS + t]
                visible[t] = kp <= qp and not (window > 0 and qp - kp >= window)
                seen += visible[t]
            if seen == 0:
                continue
            kb = _block(k, blk, D, k_scratch)
            vb = _block(v, blk, dv, v_scratch)
            if 's' in skip:
                pass
            elif scores_mode == 0:
                nxt = table[b, j + 1] if j + 1 < j1 else -1
                rowk = k.shape[2] * k.shape[3]
                rowv = v.shape[2] * v.shape[3]
                for t in range(BS):
                    if pf and nxt >= 0:
                        prefetch(k, (nxt * BS + t) * rowk, rowk)
                    if not visible[t]:
                        for h in range(H):
                            for g in range(G):
                                scores[h, g, t] = -np.inf
                        continue
                    for h in range(H):
                        key_scale = _scale(k, k_scales, blk, t, h) * (np.float32(scale) if f32s else scale)
                        for g in range(G):
                            x = np.float32(0.0)
                            if d16:
                                for d0 in range(0, D, 16):
                                    for i in range(16):
                                        x += qr[h, g, d0 + i] * _wide(kb[t, h, d0 + i])
                            else:
                                for d in range(D):
                                    x += qr[h, g, d] * _wide(kb[t, h, d])
                            scores[h, g, t] = x * key_scale
            elif scores_mode == 2:
                # per key row: every query head's 16-lane partial sums into part (L1), summed 16 keys at a time
                rowk = kb.shape[1] * kb.shape[2]
                for t0 in range(0, BS, 16):
                    for tt in range(16):
                        for h in range(H):
                            tiles.dots_lanes(qr, h * G * D, G, kb, (t0 + tt) * rowk + h * kb.shape[2], D, part16, (h * G * 16 + tt) * 16)
                    for h in range(H):
                        for g in range(G):
                            tiles.lanes_sum16(part16, (h * G + g) * 256, scores, (h * G + g) * BS + t0)
                for t in range(BS):
                    for h in range(H):
                        key_scale = _scale(k, k_scales, blk, t, h) * scale
                        for g in range(G):
                            scores[h, g, t] = scores[h, g, t] * key_scale if visible[t] else -np.inf
            else:
                # 16-lane partial sums per (key, head, query head), key-major reads; then lanes summed per key
                for t in range(BS):
                    for h in range(H):
                        for g in range(G):
                            for i in range(16):
                                x = np.float32(0.0)
                                for c in range(D // 16):
                                    x += qr[h, g, c * 16 + i] * _wide(kb[t, h, c * 16 + i])
                                part[h, g, t, i] = x
                for h in range(H):
                    for g in range(G):
                        for t in range(BS):
                            x = np.float32(0.0)
                            for i in range(16):
                                x += part[h, g, t, i]
                            scores[h, g, t] = x
                for t in range(BS):
                    for h in range(H):
                        key_scale = _scale(k, k_scales, blk, t, h) * scale
                        for g in range(G):
                            scores[h, g, t] = scores[h, g, t] * key_scale if visible[t] else -np.inf
            if 'e' not in skip:
                _softmax_block(scores, m, lsum, acc, bits, H, G, dv)
                if lh:
                    for h in range(H):
                        for g in range(G):
                            tot = np.float32(0.0)
                            for t in range(BS):
                                tot += scores[h, g, t]
                            lsum[h, g] += tot
            if 'v' in skip:
                pass
            elif not values_chunked:
                for t in range(BS):
                    if pf and nxt >= 0:
                        prefetch(v, (nxt * BS + t) * rowv, rowv)
                    if not visible[t]:
                        continue
                    for h in range(H):
                        value_scale = _scale(v, v_scales, blk, t, h)
                        for g in range(G):
                            p = scores[h, g, t]
                            if not lh:
                                lsum[h, g] += p
                            pv = p * value_scale
                            if d16 == 2:
                                for d0 in range(0, dv, 16):
                                    for i in range(16):
                                        acc[h, g, d0 + i] += pv * _wide(vb[t, h, d0 + i])
                            else:
                                for d in range(dv):
                                    acc[h, g, d] += pv * _wide(vb[t, h, d])
            else:
                for t in range(BS):  # weights: invisible keys weigh 0 (exp(-inf - m) = 0 already)
                    for h in range(H):
                        value_scale = _scale(v, v_scales, blk, t, h)
                        for g in range(G):
                            p = scores[h, g, t] if visible[t] else np.float32(0.0)
                            lsum[h, g] += p
                            scores[h, g, t] = p * value_scale
                rowv = v.shape[2] * v.shape[3]
                nxt = table[b, j + 1] if j + 1 < j1 else -1
                for t0 in range(0, BS, N):
                    if pf:
                        ta = t0 + pf
                        if ta < BS:
                            prefetch(v, (blk * BS + ta) * rowv, N * rowv)
                        elif nxt >= 0:
                            prefetch(v, (nxt * BS + ta - BS) * rowv, N * rowv)
                    whole = dv % 16 == 0
                    for tt in range(N):
                        whole = whole and visible[t0 + tt]
                    if not whole:  # a key not visible: its slot may hold anything (NaN), never read it
                        for t in range(t0, t0 + N):
                            if visible[t]:
                                for h in range(H):
                                    for g in range(G):
                                        p = scores[h, g, t]
                                        for d in range(dv):
                                            acc[h, g, d] += p * _wide(vb[t, h, d])
                        continue
                    for h in range(H):
                        for g in range(G):
                            vals(scores, (h * G + g) * BS + t0, vb, (t0 * vb.shape[1] + h) * vb.shape[2], rowv, dv, acc, (h * G + g) * dv)
        for h in range(H):
            for g in range(G):
                m_out[r, sp, h, g] = m[h, g]
                l_out[r, sp, h, g] = lsum[h, g]
                for d in range(dv):
                    out[r, sp, h, g, d] = acc[h, g, d]

    @njit(cache=False, fastmath=_FASTMATH)
    def attend_serial(q, k, v, k_scales, v_scales, dv, scale, table, kv_pos, row_seq, q_pos, window, splits, out, lse):
        out_p, m_p, l_p = _range_states(q, splits, dv)
        for w in range(q.shape[0] * splits):
            _attend_range(w, q, k, v, k_scales, v_scales, dv, scale, table, kv_pos, row_seq, q_pos, window, splits, out_p, m_p, l_p)
        merge_splits(out_p, m_p, l_p, out, lse)

    return attend_serial


from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

_I64 = ir.IntType(64)
_I32 = ir.IntType(32)


@intrinsic
def prefetch(typingctx, arr, off, count):
    """prefetch (llvm.prefetch, read, locality 3) the lines of elements off .. off + count - 1 of arr's data."""
    sig = types.none(arr, off, count)

    def codegen(context, builder, signature, args):
        a = signature.args
        data = context.make_array(a[0])(context, builder, args[0]).data
        base = builder.bitcast(builder.gep(data, [context.cast(builder, args[1], a[1], types.intp)]), ir.IntType(8).as_pointer())
        nbytes = builder.mul(context.cast(builder, args[2], a[2], types.intp), ir.Constant(_I64, context.get_abi_sizeof(context.get_data_type(a[0].dtype))))
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [ir.IntType(8).as_pointer(), _I32, _I32, _I32]), "llvm.prefetch.p0i8")
        with cgutils.for_range_slice(builder, ir.Constant(_I64, 0), nbytes, ir.Constant(_I64, 64), inc=True) as (i, _):
            builder.call(fn, [builder.gep(base, [i]), ir.Constant(_I32, 0), ir.Constant(_I32, LOCALITY), ir.Constant(_I32, 1)])
        return context.get_dummy_value()

    return sig, codegen


LOCALITY = 3


from numba.extending import overload


def _chunk(k, blk, t0, n, dv, scratch):
    raise NotImplementedError


@overload(_chunk)
def _chunk_impl(k, blk, t0, n, dv, scratch):
    if k.dtype != types.uint8:
        return lambda k, blk, t0, n, dv, scratch: k[blk, t0:t0 + n]

    def fp8(k, blk, t0, n, dv, scratch):
        src = k[blk]
        for t in range(n):
            for h in range(src.shape[1]):
                for d in range(dv):
                    scratch[t, h, d] = _wide(src[t0 + t, h, d])
        return scratch

    return fp8


def _chunk_scratch(k, n, dv):
    raise NotImplementedError


@overload(_chunk_scratch)
def _chunk_scratch_impl(k, n, dv):
    if k.dtype == types.uint8:
        return lambda k, n, dv: np.empty((n, k.shape[2], dv), dtype=np.float32)
    return lambda k, n, dv: np.empty((0, 0, 0), dtype=np.float32)


def make_chunked(CH):
    @njit(cache=False, fastmath=_FASTMATH)
    def _attend_range(w, q, k, v, k_scales, v_scales, dv, scale, table, kv_pos, row_seq, q_pos, window, splits, out, m_out, l_out):
        H, G, D = q.shape[1], q.shape[2], q.shape[3]
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
        scores = np.empty((H, G, BS), dtype=np.float32)
        bits = np.empty(BS, dtype=np.int32)
        visible = np.empty(BS, dtype=np.bool_)
        j0 = sp * per
        j1 = min(nb, j0 + per)
        n = CH if BS % CH == 0 else BS
        k_scratch = _chunk_scratch(k, n, D)
        v_scratch = _chunk_scratch(v, n, dv)
        sc = np.float32(scale)
        for j in range(j0, j1):
            blk = table[b, j]
            seen = 0
            for t in range(BS):
                kp = kv_pos[b, j * BS + t]
                visible[t] = kp <= qp and not (window > 0 and qp - kp >= window)
                seen += visible[t]
            if seen == 0:
                continue
            for t0 in range(0, BS, n):
                kb = _chunk(k, blk, t0, n, D, k_scratch)
                for tt in range(n):
                    t = t0 + tt
                    if not visible[t]:
                        for h in range(H):
                            for g in range(G):
                                scores[h, g, t] = -np.inf
                        continue
                    for h in range(H):
                        key_scale = _scale(k, k_scales, blk, t, h) * sc
                        for g in range(G):
                            x = np.float32(0.0)
                            for d in range(D):
                                x += q[r, h, g, d] * _wide(kb[tt, h, d])
                            scores[h, g, t] = x * key_scale
            _softmax_block(scores, m, lsum, acc, bits, H, G, dv)
            for t0 in range(0, BS, n):
                vb = _chunk(v, blk, t0, n, dv, v_scratch)
                for tt in range(n):
                    t = t0 + tt
                    if not visible[t]:
                        continue
                    for h in range(H):
                        value_scale = _scale(v, v_scales, blk, t, h)
                        for g in range(G):
                            p = scores[h, g, t]
                            lsum[h, g] += p
                            pv = p * value_scale
                            for d in range(dv):
                                acc[h, g, d] += pv * _wide(vb[tt, h, d])
        for h in range(H):
            for g in range(G):
                m_out[r, sp, h, g] = m[h, g]
                l_out[r, sp, h, g] = lsum[h, g]
                for d in range(dv):
                    out[r, sp, h, g, d] = acc[h, g, d]

    @njit(cache=False, fastmath=_FASTMATH)
    def attend_serial(q, k, v, k_scales, v_scales, dv, scale, table, kv_pos, row_seq, q_pos, window, splits, out, lse):
        out_p, m_p, l_p = _range_states(q, splits, dv)
        for w in range(q.shape[0] * splits):
            _attend_range(w, q, k, v, k_scales, v_scales, dv, scale, table, kv_pos, row_seq, q_pos, window, splits, out_p, m_p, l_p)
        merge_splits(out_p, m_p, l_p, out, lse)

    return attend_serial
