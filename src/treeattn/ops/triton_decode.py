"""Flash-decoding in Triton: split-KV attention for a few queries against a long KV, with lse.

Decode attention is memory-bound: each step reads the whole K/V cache to produce a handful of
query rows. This module reads every K/V byte once, at as close to the card's bandwidth as Triton
gets, in two kernels:

1. ``_split_kv_kernel``: the keys are cut into ``num_splits`` contiguous ranges, and one program
   handles one range for one (batch, KV head, row block). The rows of a program are the
   G = Hq // Hkv query heads of one GQA group times the Sq queries (row r = g * Sq + i), so each
   K/V tile is loaded once for the whole group. Scores and the online softmax run in float32;
   each program writes its partial state (o, lse) for its key range.
2. ``_merge_splits_kernel``: one program per (batch, query, head) row reduces the ``num_splits``
   partial states with the rule of ``treeattn.ops.merge_states`` (max-shifted exponentials,
   -inf safe, no atomics):

       top = max_s lse_s   (0 if every lse_s is -inf)
       w_s = exp(lse_s - top),  total = sum_s w_s
       lse = top + log(total),  out = sum_s w_s * o_s / total   (out = 0, lse = -inf if total == 0)

The same two kernels serve a contiguous KV (``decode_attention``) and a paged KV read through a
block table (``paged_decode_attention``).

Triton is an optional dependency: this module imports it at the top, so import this module only
when triton is installed (``treeattn.ops.attention`` does so lazily, for CUDA tensors only).
To run the kernels on CPU tensors through Triton's interpreter, set ``TRITON_INTERPRET=1`` in the
environment *before* this module is first imported (Triton reads it when a kernel is decorated).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from treeattn.ops.validation import check_positions, check_qkv, check_scale, check_softcap, check_window, check_window_is_causal

logger = logging.getLogger(__name__)

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
SUPPORTED_HEAD_DIMS = (16, 32, 64, 128, 256)
MAX_QUERIES = 16
# Rows (query heads of a GQA group x queries) one program holds; tl.dot needs at least 16.
MIN_BLOCK_ROWS = 16
MAX_BLOCK_ROWS = 64
# Upper bound on key ranges per (batch, KV head): the partial states stay small next to K/V.
MAX_SPLITS = 1024
# A key range spans at least this many key tiles, so the merge stays cheap for short KV.
MIN_TILES_PER_SPLIT = 4
# Programs to aim for per streaming multiprocessor when choosing num_splits. Measured on an H100
# (B = 1, Hq/Hkv = 32/8, D = 128, bf16, CUDA-graph replays): 2 beats 4 by 5 % at 64K keys and
# 9 % at 512K (benchmarks/kernels/gpu_decode.py; docs/gpu.md).
PROGRAMS_PER_SM = 2
# Bytes of one K tile (BLOCK_N keys x D): sets BLOCK_N from the head dim and dtype.
TILE_BYTES = 16 * 1024

_LN2 = math.log(2.0)
_LOG2E = 1.0 / _LN2


@triton.jit
def _split_kv_kernel(
    q_ptr, k_ptr, v_ptr, part_out_ptr, part_lse_ptr,
    q_pos_ptr, kv_pos_ptr, block_table_ptr, seq_lens_ptr, k_scale_ptr, v_scale_ptr,
    stride_qb, stride_qs, stride_qh, stride_qd,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    stride_ksb, stride_kss, stride_ksh, stride_vsb, stride_vss, stride_vsh,
    stride_po_split, stride_po_b, stride_po_q, stride_po_h,
    stride_pl_split, stride_pl_b, stride_pl_h,
    stride_qpos_b, stride_qpos_s, stride_kvpos_b, stride_kvpos_s,
    stride_bt_b, stride_bt_n, stride_sl,
    Sq, Sk, Hkv, group, split_len, block_size, window, scale_log2, softcap_log2,
    D: tl.constexpr, DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_Q_POS: tl.constexpr, HAS_KV_POS: tl.constexpr,
    PAGED: tl.constexpr, DOT_FP32: tl.constexpr, HAS_SOFTCAP: tl.constexpr, FP8_KV: tl.constexpr,
):
    """One (batch, KV head) x key range x row block: partial (o, lse) for its rows.

    Contiguous KV: k/v strides are (batch, seq, head, dim) and Sk is the key count. Paged KV
    (PAGED): k/v are pools (num_blocks, block_size, Hkv, D) whose strides are (block, slot, head,
    dim); logical key j of batch b sits in slot j % block_size of physical block
    block_table[b, j // block_size], and seq_lens[b] keys are valid. Offsets are int64 throughout.
    DOT_FP32: both products as float32 IEEE dots (float32 inputs: no TF32 rounding; bfloat16
    under the interpreter, whose tl.dot cannot take bfloat16, triton-lang/triton#11584).
    HAS_SOFTCAP: each score s = scale * q.k becomes c * tanh(s / c) where it is formed; in base 2,
    s2 = s * log2(e) becomes C * tanh(s2 / C) with C = softcap_log2 = c * log2(e).
    FP8_KV (paged only): k/v hold e4m3 codes as uint8 bytes, widened exactly to q's dtype by bit
    operations (the same on every card and under the interpreter), and k_scale/v_scale (num_blocks,
    block_size, Hkv) float32 hold each key's and value's scale: a key's scale multiplies its score,
    a value's its softmax weight (FlashInfer folds its per-tensor scales the same way).
    """
    bh = tl.program_id(0)
    split = tl.program_id(1)
    row_block = tl.program_id(2)
    b = (bh // Hkv).to(tl.int64)
    kv_head = (bh % Hkv).to(tl.int64)

    rows = row_block * BLOCK_M + tl.arange(0, BLOCK_M)
    row_valid = rows < group * Sq
    g = rows // Sq
    i = (rows % Sq).to(tl.int64)
    head = kv_head * group + g.to(tl.int64)
    offs_d = tl.arange(0, D)
    offs_dv = tl.arange(0, DV)

    q_rows = q_ptr + b * stride_qb + i * stride_qs + head * stride_qh
    q = tl.load(q_rows[:, None] + offs_d[None, :] * stride_qd, mask=row_valid[:, None], other=0.0)

    if PAGED:
        seq_len = tl.load(seq_lens_ptr + b * stride_sl).to(tl.int32)
    else:
        seq_len = Sk
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)

    if CAUSAL or HAS_WINDOW:
        if HAS_Q_POS:
            q_pos = tl.load(q_pos_ptr + b * stride_qpos_b + i * stride_qpos_s, mask=row_valid, other=0)
        else:
            q_pos = i + (seq_len - Sq)  # bottom-right alignment

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, DV], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        key_valid = n < end
        n64 = n.to(tl.int64)
        if PAGED:
            block_id = tl.load(block_table_ptr + b * stride_bt_b + (n64 // block_size) * stride_bt_n,
                               mask=key_valid, other=0).to(tl.int64)
            slot = n64 % block_size
            k_rows = k_ptr + block_id * stride_kb + slot * stride_ks + kv_head * stride_kh
            v_rows = v_ptr + block_id * stride_vb + slot * stride_vs + kv_head * stride_vh
        else:
            k_rows = k_ptr + b * stride_kb + n64 * stride_ks + kv_head * stride_kh
            v_rows = v_ptr + b * stride_vb + n64 * stride_vs + kv_head * stride_vh
        if FP8_KV:
            k = _e4m3_to_float(tl.load(k_rows[:, None] + offs_d[None, :] * stride_kd, mask=key_valid[:, None],
                                       other=0)).to(q.dtype)
            v = _e4m3_to_float(tl.load(v_rows[:, None] + offs_dv[None, :] * stride_vd, mask=key_valid[:, None],
                                       other=0)).to(q.dtype)
            k_scale = tl.load(k_scale_ptr + block_id * stride_ksb + slot * stride_kss + kv_head * stride_ksh, mask=key_valid,
                              other=0.0)
            v_scale = tl.load(v_scale_ptr + block_id * stride_vsb + slot * stride_vss + kv_head * stride_vsh, mask=key_valid,
                              other=0.0)
        else:
            k = tl.load(k_rows[:, None] + offs_d[None, :] * stride_kd, mask=key_valid[:, None], other=0.0)
            v = tl.load(v_rows[:, None] + offs_dv[None, :] * stride_vd, mask=key_valid[:, None], other=0.0)

        if DOT_FP32:
            scores = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            scores = tl.dot(q, tl.trans(k))
        if FP8_KV:
            scores = scores * k_scale[None, :]
        scores = scores * scale_log2  # base-2 logits: exp(x) == exp2(x * log2(e))
        if HAS_SOFTCAP:  # tanh(x) = sign(x) (1 - e) / (1 + e), e = exp(-2|x|) in (0, 1]: never overflows
            x = scores / softcap_log2
            e = tl.exp(-2.0 * tl.abs(x))
            scores = softcap_log2 * tl.where(x < 0, -1.0, 1.0) * (1.0 - e) / (1.0 + e)
        visible = key_valid[None, :]
        if CAUSAL or HAS_WINDOW:
            if HAS_KV_POS:
                kv_pos = tl.load(kv_pos_ptr + b * stride_kvpos_b + n64 * stride_kvpos_s, mask=key_valid, other=0)
            else:
                kv_pos = n64
            distance = q_pos[:, None] - kv_pos[None, :]
            if CAUSAL:
                visible = visible & (distance >= 0)
            if HAS_WINDOW:
                visible = visible & (distance < window)
        scores = tl.where(visible, scores, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(scores, 1))
        m_base = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet
        alpha = tl.exp2(m_i - m_base)
        p = tl.exp2(scores - m_base[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if FP8_KV:
            p = p * v_scale[None, :]  # the values' scales go with their weights (l_i sums the weights alone)
        if DOT_FP32:  # p rounded to v's dtype as on the tensor-core path, then an exact fp32 dot
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype).to(tl.float32), v.to(tl.float32), input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    seen = l_i > 0.0
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    lse = tl.where(seen, (m_i + tl.log2(tl.where(seen, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
    po_rows = part_out_ptr + split * stride_po_split + b * stride_po_b + i * stride_po_q + head * stride_po_h
    tl.store(po_rows[:, None] + offs_dv[None, :], out, mask=row_valid[:, None])
    tl.store(part_lse_ptr + split * stride_pl_split + b * stride_pl_b + head * stride_pl_h + i, lse, mask=row_valid)


@triton.jit
def _e4m3_to_float(bits):
    """e4m3fn codes (uint8) -> float32, exactly: exponent and mantissa moved into a float32's place,
    scaled by 2**120 (e4m3's bias 7 -> float32's 127; subnormals come out normalized), the sign
    put back; S.1111.111 is NaN (e4m3fn has no infinities)."""
    x = bits.to(tl.uint32)
    magnitude = ((x & 0x7F) << 20).to(tl.float32, bitcast=True) * 1.329227995784916e36  # 2**120
    value = tl.where((x & 0x80) != 0, -magnitude, magnitude)
    return tl.where((x & 0x7F) == 0x7F, float("nan"), value)


@triton.jit
def _merge_splits_kernel(
    part_out_ptr, part_lse_ptr, out_ptr, lse_ptr,
    num_splits, Sq, Hq, Dv,
    stride_po_split, stride_po_b, stride_po_q, stride_po_h,
    stride_pl_split, stride_pl_b, stride_pl_h, stride_pl_q,
    stride_ob, stride_oq, stride_oh, stride_od,
    stride_lb, stride_lh, stride_lq,
    BLOCK_S: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    """One (batch, head, query) row: merge num_splits states (o_s, lse_s) as merge_states does."""
    row = tl.program_id(0)
    i = (row % Sq).to(tl.int64)
    h = ((row // Sq) % Hq).to(tl.int64)
    b = (row // (Sq * Hq)).to(tl.int64)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_DV)
    d_valid = offs_d < Dv
    lse_row = part_lse_ptr + b * stride_pl_b + h * stride_pl_h + i * stride_pl_q
    out_row = part_out_ptr + b * stride_po_b + i * stride_po_q + h * stride_po_h

    top = tl.full([BLOCK_S], float("-inf"), tl.float32)
    for s0 in range(0, num_splits, BLOCK_S):
        s = s0 + offs_s
        top = tl.maximum(top, tl.load(lse_row + s * stride_pl_split, mask=s < num_splits, other=float("-inf")))
    top_all = tl.max(top, 0)
    top_all = tl.where(top_all == float("-inf"), 0.0, top_all)

    total = tl.zeros([BLOCK_S], tl.float32)
    acc = tl.zeros([BLOCK_DV], tl.float32)
    for s0 in range(0, num_splits, BLOCK_S):
        s = s0 + offs_s
        s_valid = s < num_splits
        weight = tl.exp(tl.load(lse_row + s * stride_pl_split, mask=s_valid, other=float("-inf")) - top_all)
        o = tl.load(out_row + s[:, None] * stride_po_split + offs_d[None, :],
                    mask=s_valid[:, None] & d_valid[None, :], other=0.0)
        total += weight
        acc += tl.sum(weight[:, None] * o, 0)
    total_all = tl.sum(total, 0)
    seen = total_all > 0.0  # False: the row saw no key in any split
    out = acc / tl.where(seen, total_all, 1.0)
    lse = tl.where(seen, top_all + tl.log(tl.where(seen, total_all, 1.0)), float("-inf"))
    tl.store(out_ptr + b * stride_ob + i * stride_oq + h * stride_oh + offs_d * stride_od,
             out.to(out_ptr.dtype.element_ty), mask=d_valid)
    tl.store(lse_ptr + b * stride_lb + h * stride_lh + i * stride_lq, lse)


def unsupported_reason(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> str | None:
    """Why the kernel cannot take these (already validated) inputs, or None if it can.

    Args:
        q: (B, Sq, Hq, D); k: (B or num_blocks, Sk or block_size, Hkv, D); v: (..., Hkv, Dv).
    """
    if q.dtype not in SUPPORTED_DTYPES:
        return f"dtype {q.dtype} (the kernel takes float16, bfloat16, float32)"
    D, Dv = q.shape[-1], v.shape[-1]
    if D not in SUPPORTED_HEAD_DIMS or Dv not in SUPPORTED_HEAD_DIMS:
        return f"head dims D={D}, Dv={Dv} (the kernel takes powers of two from 16 to 256)"
    if q.shape[1] > MAX_QUERIES:
        return f"Sq={q.shape[1]} queries (the decode kernel takes 1 to {MAX_QUERIES}; prefill uses the generic path)"
    if q.device.type != "cuda" and not _INTERPRETED:
        return f"device {q.device} (the kernel needs CUDA tensors, or TRITON_INTERPRET=1 set before import)"
    return None


def decode_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float | None = None,
    causal: bool = False,
    q_pos: torch.Tensor | None = None,
    kv_pos: torch.Tensor | None = None,
    window: int | None = None,
    num_splits: int | None = None,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Flash-decoding attention over a contiguous KV, returning the state (out, lse).

    Same contract as ``treeattn.ops.attention``, restricted to what the kernel takes.

    Args:
        q: (B, Sq, Hq, D), 1 <= Sq <= 16, float16, bfloat16 or float32, any strides.
        k: (B, Sk, Hkv, D), same dtype and device, any strides (no copy is made); Hq % Hkv == 0.
        v: (B, Sk, Hkv, Dv), any strides. D and Dv are powers of two from 16 to 256.
        scale: softmax scale, default D ** -0.5.
        causal: mask keys after the query. Without positions, query i sits at Sk - Sq + i.
        q_pos: int64 (Sq,) or (B, Sq) query positions (with causal or window).
        kv_pos: int64 (Sk,) or (B, Sk) key positions, any order (with causal or window).
        window: causal sliding window W (only with causal=True): a key is visible only if 0 <= q_pos - kv_pos < W.
        num_splits: key ranges per (batch, KV head); default fills the GPU (a few programs per SM).
        softcap: logit soft-capping c: scores s become c * tanh(s / c); None: none.

    Returns:
        out: (B, Sq, Hq, Dv) in q.dtype; lse: (B, Hq, Sq) float32, natural log, scale included.
        A row that sees no key has out = 0 and lse = -inf.

    Raises:
        ValueError / TypeError for bad or unsupported inputs; RuntimeError naming the shapes if
        a kernel launch fails.
    """
    B, Sq, Sk, Hq, Hkv, D, Dv = check_qkv(q, k, v)
    scale, causal, window, q_pos, kv_pos = _check_mask_args(q, scale, causal, q_pos, kv_pos, window, B, Sq, Sk, D)
    _raise_if_unsupported(q, k, v)
    return _decode(q, k, v, None, None, Sk, scale, causal, q_pos, kv_pos, window, num_splits, check_softcap(softcap))


def paged_decode_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    scale: float | None = None,
    causal: bool = False,
    q_pos: torch.Tensor | None = None,
    kv_pos: torch.Tensor | None = None,
    window: int | None = None,
    num_splits: int | None = None,
    softcap: float | None = None,
    k_scales: torch.Tensor | None = None,
    v_scales: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Flash-decoding attention over a paged KV cache read through a block table.

    Block-table convention: the keys of sequence b are its logical slots j = 0 .. seq_lens[b] - 1;
    slot j lives at ``k_pool[block_table[b, j // block_size], j % block_size]`` (likewise v).
    Table entries past a sequence's last used block are never read (they may hold anything, e.g.
    -1). Nothing is synchronized with the host: seq_lens is read on the device, and the launch
    grid covers the table's capacity max_blocks * block_size, so the call can be captured in a
    CUDA graph.

    Args:
        q: (B, Sq, Hq, D), 1 <= Sq <= 16, float16, bfloat16 or float32.
        k_pool: (num_blocks, block_size, Hkv, D), same dtype and device (or float8_e4m3fn codes with
            k_scales), any strides.
        v_pool: (num_blocks, block_size, Hkv, Dv), any strides.
        block_table: (B, max_blocks) int32 physical block ids, any strides.
        seq_lens: (B,) int32 or int64 valid keys per sequence, 0 <= seq_lens[b] <= max_blocks * block_size;
            any stride.
        scale, causal, window: as in ``decode_attention``. Without q_pos, query i of sequence b
            sits at position seq_lens[b] - Sq + i (bottom-right).
        q_pos: int64 (Sq,) or (B, Sq) query positions.
        kv_pos: int64 (L,) or (B, L), L = max_blocks * block_size: the position of logical slot j;
            default j.
        num_splits: key ranges per (batch, KV head) over the table's capacity.
        softcap: as in ``decode_attention``.
        k_scales, v_scales: float32 (num_blocks, block_size, Hkv), any strides, exactly when the pools
            are float8_e4m3fn (an fp8 KV cache, treeattn.ops.fp8): key (b, t, h) is
            k_pool[b, t, h] * k_scales[b, t, h], likewise the values; read in place, the scales
            folded into the scores and the softmax weights, float32 accumulation.

    Returns:
        out: (B, Sq, Hq, Dv) in q.dtype; lse: (B, Hq, Sq) float32. A row that sees no key (e.g.
        seq_lens[b] == 0) has out = 0 and lse = -inf.
    """
    B, Sq, Hq, Hkv, D, Dv, capacity = _check_paged(q, k_pool, v_pool, block_table, seq_lens, k_scales, v_scales)
    scale, causal, window, q_pos, kv_pos = _check_mask_args(q, scale, causal, q_pos, kv_pos, window, B, Sq, capacity, D)
    _raise_if_unsupported(q, k_pool, v_pool)
    return _decode(q, k_pool, v_pool, block_table, seq_lens, capacity, scale, causal, q_pos, kv_pos, window, num_splits,
                   check_softcap(softcap), k_scales, v_scales)


def merge_split_states(part_out: torch.Tensor, part_lse: torch.Tensor,
                       out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge stacked attention states with the Triton reduction (the rule of merge_states_list).

    Args:
        part_out: (n, B, Sq, Hq, Dv) float32, n >= 1, last dim contiguous.
        part_lse: (n, B, Hq, Sq) float32; -inf marks a state that saw no key.
        out_dtype: dtype of the merged out.

    Returns:
        out: (B, Sq, Hq, Dv) in out_dtype; lse: (B, Hq, Sq) float32.
    """
    if part_out.dim() != 5 or part_out.dtype != torch.float32 or part_out.stride(-1) != 1:
        raise ValueError(f"part_out must be float32 (n, B, Sq, Hq, Dv) with a contiguous last dim, got {tuple(part_out.shape)} "
                         f"{part_out.dtype} strides {part_out.stride()}")
    n, B, Sq, Hq, Dv = part_out.shape
    if tuple(part_lse.shape) != (n, B, Hq, Sq) or part_lse.dtype != torch.float32:
        raise ValueError(f"part_lse must be float32 {(n, B, Hq, Sq)} to match part_out, got {tuple(part_lse.shape)} "
                         f"{part_lse.dtype}")
    out = torch.empty(B, Sq, Hq, Dv, dtype=out_dtype, device=part_out.device)
    lse = torch.empty(B, Hq, Sq, dtype=torch.float32, device=part_out.device)
    if out.numel() == 0 or lse.numel() == 0:
        out.zero_()
        lse.fill_(float("-inf"))
        return out, lse
    _launch_merge(part_out, part_lse, out, lse)
    return out, lse


def try_decode_attention(q, k, v, *, scale, causal, q_pos, kv_pos, window, softcap=None):
    """The kernel's (out, lse) for validated inputs, or None (reason logged) if it cannot take them.

    The dispatch hook of ``treeattn.ops.attention``: arguments are already checked there, with
    positions as int64 (B or 1, S) or None and scale a float.
    """
    reason = unsupported_reason(q, k, v)
    if reason is not None:
        _log_fallback(reason)
        return None
    return _decode(q, k, v, None, None, k.shape[1], scale, causal, q_pos, kv_pos, window, None, softcap)


# --- internals -------------------------------------------------------------------------------

_INTERPRETED = isinstance(_split_kv_kernel, InterpretedFunction)


def _check_paged(q, k_pool, v_pool, block_table, seq_lens, k_scales=None, v_scales=None) -> tuple[int, int, int, int, int, int,
                                                                                                  int]:
    """Validate the paged inputs; returns (B, Sq, Hq, Hkv, D, Dv, capacity = max_blocks * block_size)."""
    fp8 = isinstance(k_pool, torch.Tensor) and k_pool.dtype == torch.float8_e4m3fn
    for name, t, layout in (
        ("q", q, "(B, Sq, Hq, D)"),
        ("k_pool", k_pool, "(num_blocks, block_size, Hkv, D)"),
        ("v_pool", v_pool, "(num_blocks, block_size, Hkv, Dv)"),
    ):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"{name} must be a 4-dim tensor {layout}, got {_shape_of(t)}")
        if t.dtype not in SUPPORTED_DTYPES + (torch.float64,) and not (fp8 and name != "q"):
            raise TypeError(f"{name} must be float32, float16, bfloat16 or float64 (pools: or float8_e4m3fn), got {t.dtype}")
    if (v_pool.dtype != k_pool.dtype) or (k_pool.dtype != q.dtype and not fp8):
        raise TypeError(f"q, k_pool, v_pool must share one dtype (or the pools be float8_e4m3fn), got q {q.dtype}, "
                        f"k_pool {k_pool.dtype}, v_pool {v_pool.dtype}")
    for name, t in (("k_scales", k_scales), ("v_scales", v_scales)):
        if fp8 and (not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or tuple(t.shape) != tuple(k_pool.shape[:3])
                    or t.device != q.device):
            raise TypeError(f"{name} must be a float32 tensor of shape (num_blocks, block_size, Hkv) = {tuple(k_pool.shape[:3])} "
                            f"on {q.device} with float8_e4m3fn pools, got {_shape_of(t)}")
        if not fp8 and t is not None:
            raise TypeError(f"{name} goes with float8_e4m3fn pools only, got {k_pool.dtype} pools")
    B, Sq, Hq, D = q.shape
    num_blocks, block_size, Hkv, Dk = k_pool.shape
    if tuple(v_pool.shape[:3]) != (num_blocks, block_size, Hkv):
        raise ValueError(f"k_pool {tuple(k_pool.shape)} and v_pool {tuple(v_pool.shape)} must agree on (num_blocks, block_size, "
                         f"Hkv)")
    if Dk != D:
        raise ValueError(f"head dim mismatch: q has D={D} (shape {tuple(q.shape)}), k_pool has D={Dk} (shape "
                         f"{tuple(k_pool.shape)})")
    if block_size == 0 or Hq == 0 or Hkv == 0 or Hq % Hkv != 0:
        raise ValueError(f"k_pool must have block_size >= 1 and Hkv dividing Hq={Hq}, got shape {tuple(k_pool.shape)}")
    if not isinstance(block_table, torch.Tensor) or block_table.dim() != 2 or block_table.shape[0] != B:
        raise ValueError(f"block_table must have shape ({B}, max_blocks), got {_shape_of(block_table)}")
    if block_table.dtype != torch.int32:
        raise TypeError(f"block_table must be int32, got {block_table.dtype}")
    if not isinstance(seq_lens, torch.Tensor) or tuple(seq_lens.shape) != (B,):
        raise ValueError(f"seq_lens must have shape ({B},), got {_shape_of(seq_lens)}")
    if seq_lens.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"seq_lens must be int32 or int64, got {seq_lens.dtype}")
    for name, t in (("k_pool", k_pool), ("v_pool", v_pool), ("block_table", block_table), ("seq_lens", seq_lens)):
        if t.device != q.device:
            raise ValueError(f"{name} must be on the device of q ({q.device}), got {t.device}")
    return B, Sq, Hq, Hkv, D, v_pool.shape[3], block_table.shape[1] * block_size


def _shape_of(t) -> str:
    return str(tuple(t.shape)) if isinstance(t, torch.Tensor) else type(t).__name__


def _check_mask_args(q, scale, causal, q_pos, kv_pos, window, B, Sq, Sk, D):
    scale = check_scale(scale, D)
    window = check_window(window)
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    check_window_is_causal(window, causal)
    q_pos = check_positions(q_pos, "q_pos", B, Sq, q.device)
    kv_pos = check_positions(kv_pos, "kv_pos", B, Sk, q.device)
    if not causal and (q_pos is not None or kv_pos is not None):
        raise ValueError("q_pos/kv_pos only take effect with causal=True; pass causal=True")
    return scale, causal, window, q_pos, kv_pos


def _raise_if_unsupported(q, k, v) -> None:
    reason = unsupported_reason(q, k, v)
    if reason is not None:
        raise ValueError(f"the Triton decode kernel does not take {reason}")


_logged_reasons: set[str] = set()


def _log_fallback(reason: str) -> None:
    """Log at INFO the first time a reason occurs, at DEBUG after (decode loops repeat it)."""
    level = logging.DEBUG if reason in _logged_reasons else logging.INFO
    _logged_reasons.add(reason)
    logger.log(level, "Triton decode kernel skipped, generic path used: %s", reason)


def _pick_tiles(block_m: int, D: int, Dv: int, element_size: int) -> tuple[int, int, int]:
    """(BLOCK_N, num_warps, num_stages) for the split kernel; not yet tuned for speed on a GPU.

    A 16-bit K tile holds at most TILE_BYTES (64 keys x 128 dims); float32, whose IEEE dots run
    on FMA units, takes 16-key tiles and 8 warps; three pipeline stages for 16-row blocks, two
    for larger ones. Compiled offline for sm_80 and sm_90 (``benchmarks/kernels/gpu_decode.py
    --compile-only``), every dtype x D in {64, 128, 256} x {4, 64} rows x {contiguous, paged}
    pipelines its K/V loads, uses at most ~100 KiB of shared memory and spills nothing but 8
    bytes in one case (float32, D = 64, 64 rows, sm_80).
    """
    if element_size == 4:
        block_n, num_warps = 16, 8
    else:
        block_n = min(64, TILE_BYTES // (max(D, Dv) * element_size))
        num_warps = 4 if block_m <= 16 else 8
    num_stages = 3 if block_m <= 16 else 2
    return block_n, num_warps, num_stages


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of the device (cached: the query costs tens of microseconds)."""
    if device.type != "cuda":
        return 1  # interpreter: few programs keep it fast
    return torch.cuda.get_device_properties(device).multi_processor_count


def _plan_splits(capacity: int, programs_per_split: int, block_n: int, num_splits: int | None, device) -> tuple[int, int]:
    """Return (num_splits, split_len): split_len a multiple of block_n, num_splits * split_len >= capacity."""
    tiles = triton.cdiv(capacity, block_n)
    if num_splits is None:
        num_splits = triton.cdiv(PROGRAMS_PER_SM * _sm_count(device), programs_per_split)
        num_splits = min(num_splits, triton.cdiv(tiles, MIN_TILES_PER_SPLIT))
    elif isinstance(num_splits, bool) or not isinstance(num_splits, int) or num_splits < 1:
        raise ValueError(f"num_splits must be a positive int or None, got {num_splits!r}")
    num_splits = max(1, min(num_splits, tiles, MAX_SPLITS))
    split_len = triton.cdiv(tiles, num_splits) * block_n
    return triton.cdiv(capacity, split_len), split_len


def _describe(**tensors) -> str:
    return ", ".join(
        f"{name} {tuple(t.shape)} {t.dtype} strides {t.stride()}" for name, t in tensors.items() if t is not None
    )


def _decode(q, k, v, block_table, seq_lens, capacity, scale, causal, q_pos, kv_pos, window, num_splits, softcap=None,
            k_scales=None, v_scales=None):
    """Run both kernels. k, v are (B, Sk, ...) or pools (num_blocks, block_size, ...) if block_table
    is given (float8_e4m3fn pools with their k_scales, v_scales)."""
    B, Sq, Hq, D = q.shape
    Hkv, Dv = k.shape[2], v.shape[3]
    paged = block_table is not None
    if B == 0 or Sq == 0 or capacity == 0:  # nothing to launch: every row sees no key
        return (torch.zeros(B, Sq, Hq, Dv, dtype=q.dtype, device=q.device),
                torch.full((B, Hq, Sq), float("-inf"), dtype=torch.float32, device=q.device))
    out = torch.empty(B, Sq, Hq, Dv, dtype=q.dtype, device=q.device)
    lse = torch.empty(B, Hq, Sq, dtype=torch.float32, device=q.device)

    group = Hq // Hkv
    rows = group * Sq
    block_m = min(max(MIN_BLOCK_ROWS, triton.next_power_of_2(rows)), MAX_BLOCK_ROWS)
    row_blocks = triton.cdiv(rows, block_m)
    block_n, num_warps, num_stages = _pick_tiles(block_m, D, Dv, q.element_size())
    num_splits, split_len = _plan_splits(capacity, B * Hkv * row_blocks, block_n, num_splits, q.device)
    part_out = torch.empty(num_splits, B, Sq, Hq, Dv, dtype=torch.float32, device=q.device)
    part_lse = torch.empty(num_splits, B, Hq, Sq, dtype=torch.float32, device=q.device)

    masked = causal or window is not None
    has_q_pos = masked and q_pos is not None
    has_kv_pos = masked and kv_pos is not None
    qpos_strides = (q_pos.stride(0) if q_pos.shape[0] > 1 else 0, q_pos.stride(1)) if has_q_pos else (0, 0)
    kvpos_strides = (kv_pos.stride(0) if kv_pos.shape[0] > 1 else 0, kv_pos.stride(1)) if has_kv_pos else (0, 0)
    # The kernel does not read the pointers a constexpr flag switches off; any tensor will do.
    dummy = part_lse
    fp8 = k_scales is not None
    grid = (B * Hkv, num_splits, row_blocks)
    try:
        with _on_device(q.device):
            _split_kv_kernel[grid](
                q, k.view(torch.uint8) if fp8 else k, v.view(torch.uint8) if fp8 else v, part_out, part_lse,
                q_pos if has_q_pos else dummy, kv_pos if has_kv_pos else dummy,
                block_table if paged else dummy, seq_lens if paged else dummy,
                k_scales if fp8 else dummy, v_scales if fp8 else dummy,
                *q.stride(), *k.stride(), *v.stride(),
                *(k_scales.stride() if fp8 else (0, 0, 0)), *(v_scales.stride() if fp8 else (0, 0, 0)),
                *part_out.stride()[:4], *part_lse.stride()[:3],
                *qpos_strides, *kvpos_strides,
                *(block_table.stride() if paged else (0, 0)), seq_lens.stride(0) if paged else 0,
                Sq, capacity, Hkv, group, split_len, k.shape[1] if paged else 1,
                window if window is not None else 0, scale * _LOG2E, (softcap if softcap is not None else 1.0) * _LOG2E,
                D=D, DV=Dv, BLOCK_M=block_m, BLOCK_N=block_n,
                CAUSAL=causal, HAS_WINDOW=window is not None, HAS_Q_POS=has_q_pos, HAS_KV_POS=has_kv_pos,
                PAGED=paged, DOT_FP32=q.dtype == torch.float32 or (_INTERPRETED and q.dtype == torch.bfloat16),
                HAS_SOFTCAP=softcap is not None, FP8_KV=fp8,
                num_warps=num_warps, num_stages=num_stages,
            )
            _launch_merge(part_out, part_lse, out, lse)
    except Exception as exc:
        shapes = _describe(q=q, k_pool=k, v_pool=v, block_table=block_table,
                           seq_lens=seq_lens) if paged else _describe(q=q, k=k, v=v)
        raise RuntimeError(
            f"Triton decode kernel failed for {shapes}; grid {grid}, num_splits {num_splits}, "
            f"split_len {split_len}, BLOCK_M {block_m}, BLOCK_N {block_n}: {type(exc).__name__}: {exc}"
        ) from exc
    return out, lse


def _launch_merge(part_out, part_lse, out, lse) -> None:
    n, B, Sq, Hq, Dv = part_out.shape
    block_s = min(triton.next_power_of_2(n), 32)
    with _on_device(out.device):
        _merge_splits_kernel[(B * Sq * Hq,)](
            part_out, part_lse, out, lse,
            n, Sq, Hq, Dv,
            *part_out.stride()[:4], *part_lse.stride(),
            *out.stride(), *lse.stride(),
            BLOCK_S=block_s, BLOCK_DV=triton.next_power_of_2(Dv),
            num_warps=4 if Dv >= 128 else 2,
        )


def _on_device(device: torch.device):
    """Triton launches on the current CUDA device; make it the tensors' device (if it is not already)."""
    if device.type == "cuda" and device.index is not None and device.index != torch.cuda.current_device():
        return torch.cuda.device(device)
    return contextlib.nullcontext()
