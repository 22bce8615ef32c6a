"""Single-device exact attention that returns (out, lse), with memory bounded by the chunk size.

The keys are processed in chunks and the per-chunk states are combined with merge_states, so a
one-token query over millions of keys needs only O(chunk) extra memory (flash-decoding /
memory-efficient attention). Grouped-query attention is folded into the row dimension: the G query
heads that share one KV head become G rows of one matrix product, so every K/V byte is read once
per step, not G times.

On the CPU, decode-sized calls (at most 16 queries per sequence; float32, bfloat16 or float16;
no softcap) run the compiled kernel of treeattn.ops.cpu_decode when numba is installed: one pass
over the keys in place per KV head and its G query heads, float32 online softmax, block ranges in
parallel (0.27-0.67x the matmul path's time at 4K-64K keys, docs/benchmarks.md). Other decode-sized work (<= 64 query
rows per KV head; float64, a softcap, no numba) runs a float32 matmul path with an online softmax
over cache-sized key chunks, measured faster there than torch's fused flash-attention kernel;
longer query blocks (prefill) run in that kernel, which also returns the logsumexp. Other devices without the Triton kernel, and
head dims the fused kernel does not take,
use the matmul path too, and so does every call with a softcap (Gemma 2 logit capping), since the
fused kernel takes no transform of the scores.
CUDA tensors go to the Triton flash-decoding kernel (treeattn.ops.triton_decode) when triton is
installed and the kernel takes the inputs (Sq <= 16, fp16/bf16/fp32, power-of-two head dims).
Longer fp16/bf16 query blocks on CUDA (prefill, ring-attention blocks) run torch's fused CUDA
flash kernel, which returns the logsumexp, for unmasked blocks and causal blocks of contiguous
positions; other masked blocks use the matmul path.

The generic path (every input the kernel declines) picks shortcuts by reading device values on the
host (is every key visible? are the positions one range? does a chunk see any key?): on a GPU each
read synchronizes and cannot be captured in a CUDA graph. treeattn.ops.graph_safe is the variant
with no host read; it refuses, rather than falls back on, inputs the kernel does not take.
"""

from __future__ import annotations


import torch

from treeattn.ops.kernels import optional_kernel
from treeattn.ops import cpu_decode
from treeattn.ops.merge import merge_states
from treeattn.ops.validation import (
    check_positions,
    check_qkv,
    check_scale,
    check_softcap,
    check_window,
    check_window_is_causal,
)

# Keys per chunk when a mask must be built (its size is rows x chunk). Without a mask the fused
# CPU kernel streams the whole KV itself in bounded memory, so no chunking is needed.
MASKED_CHUNK_KEYS = 8192
# Bound on the elements of one score block (matmul path) or one mask block (fused path).
MAX_SCORE_ELEMENTS = 1 << 22
# Score elements per key chunk of the matmul path: small enough to stay in cache.
CACHE_SCORE_ELEMENTS = 1 << 15
# Queries per block of causal attention over contiguous positions (prefill) on the CPU. On CUDA the
# whole query range is one block: the fused kernel streams it in bounded memory, and fewer, larger
# calls run 2-3x faster there (32K causal prefill on an H100: benchmarks/kernels/gpu_prefill.py).
CAUSAL_QUERY_BLOCK = 512

_cpu_flash = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_cuda_flash = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention", None)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float | None = None,
    causal: bool = False,
    q_pos: torch.Tensor | None = None,
    kv_pos: torch.Tensor | None = None,
    window: int | None = None,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact softmax attention over all keys, returning the attention state (out, lse).

    Args:
        q: (B, Sq, Hq, D) float32, float16, bfloat16 or float64, any strides (results do not
            depend on the memory layout). B and Sq may be 0; Hq, D >= 1.
        k: (B, Sk, Hkv, D), same dtype and device; Hq % Hkv == 0 (GQA; Hkv == 1 is MQA). Sk may be 0.
        v: (B, Sk, Hkv, Dv), Dv >= 1.
        scale: softmax scale, default D ** -0.5.
        causal: mask keys whose position is after the query's. Without positions the alignment is
            bottom-right: query i sits at position Sk - Sq + i, key j at position j.
        q_pos: int64 (Sq,) or (B, Sq), absolute positions of the queries.
        kv_pos: int64 (Sk,) or (B, Sk), absolute positions of the keys (any order).
        window: causal sliding window W, only with causal=True: a key is visible only if
            0 <= q_pos - kv_pos < W. Without causal=True it raises ValueError (two-sided windows,
            flash-attn's window_size=(left, right), are not supported).
        softcap: logit soft-capping c (Gemma 2): each score s = scale * q.k becomes
            c * tanh(s / c) before the softmax. None: no capping.

    Returns:
        out: (B, Sq, Hq, Dv) in q.dtype.
        lse: (B, Hq, Sq) float32 (float64 for float64 inputs), natural log of the sum of
            exp(score) over the visible keys (score = scale * q.k, capped if softcap is given).
            A row that sees no key has out = 0, lse = -inf.

    Example (one decode query over 300 keys, grouped-query heads)::

        >>> import torch, treeattn as ta
        >>> q = torch.randn(2, 1, 8, 64)                                    # (B, Sq, Hq, D)
        >>> k, v = torch.randn(2, 300, 2, 64), torch.randn(2, 300, 2, 64)   # (B, Sk, Hkv, D): 4 query heads per KV head
        >>> out, lse = ta.attention(q, k, v)
        >>> out.shape, lse.shape, lse.dtype
        (torch.Size([2, 1, 8, 64]), torch.Size([2, 8, 1]), torch.float32)
        >>> ref, ref_lse = ta.reference_attention(q, k, v)                  # float64, naive
        >>> torch.allclose(out.double(), ref, atol=1e-5) and torch.allclose(lse.double(), ref_lse, atol=1e-5)
        True
        >>> out, lse = ta.attention(q[:1], k[:1, :10], v[:1, :10], causal=True,   # a sliding window of 4
        ...                         q_pos=torch.tensor([9]), kv_pos=torch.arange(10), window=4)
        >>> torch.allclose(out, ta.attention(q[:1], k[:1, 6:10], v[:1, 6:10])[0], atol=1e-6)
        True
    """
    B, Sq, Sk, Hq, Hkv, D, Dv = check_qkv(q, k, v)
    scale = check_scale(scale, D)
    window = check_window(window)
    softcap = check_softcap(softcap)
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    check_window_is_causal(window, causal)
    q_pos = check_positions(q_pos, "q_pos", B, Sq, q.device)
    kv_pos = check_positions(kv_pos, "kv_pos", B, Sk, q.device)
    masked = causal
    if not masked and (q_pos is not None or kv_pos is not None):
        raise ValueError("q_pos/kv_pos only take effect with causal=True; pass causal=True")
    if q.device.type == "cuda" and (triton_decode := _triton_decode_module()) is not None:
        decoded = triton_decode.try_decode_attention(
            q, k, v, scale=scale, causal=causal, q_pos=q_pos, kv_pos=kv_pos, window=window, softcap=softcap
        )
        if decoded is not None:  # None: the kernel does not take these inputs (reason logged)
            return decoded
    if masked:
        if kv_pos is None:
            kv_pos = torch.arange(Sk, device=q.device).unsqueeze(0)
        if q_pos is None:
            q_pos = (torch.arange(Sq, device=q.device) + (Sk - Sq)).unsqueeze(0)

    if q.device.type == "cpu" and softcap is None and Sq <= cpu_decode.MAX_QUERIES:  # decode-sized: the compiled kernel
        decoded = cpu_decode.decode_attention(q, k, v, scale=scale, q_pos=q_pos, kv_pos=kv_pos, window=window)
        if decoded is not None:  # None: no numba, float64, no keys, or a query position below 0
            return decoded

    lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    if B == 0 or Sq == 0 or Sk == 0:  # nothing to compute: empty, or rows that see no key
        return (
            torch.zeros(B, Sq, Hq, Dv, dtype=q.dtype, device=q.device),
            torch.full((B, Hq, Sq), float("-inf"), dtype=lse_dtype, device=q.device),
        )

    group = Hq // Hkv
    use_flash = softcap is None and _fused_flash_takes(q, D, Dv, group * Sq)  # fused kernels take no score transform
    if use_flash:  # once here, not per block: the fused kernels read only some layouts correctly
        q, k, v = fused_kernel_layout(q), fused_kernel_layout(k), fused_kernel_layout(v)
    # Fold GQA: (B, Sq, Hkv, G, D) -> (B, Hkv, G * Sq, D); row r = g * Sq + i.
    q_rows = q.view(B, Sq, Hkv, group, D).permute(0, 2, 3, 1, 4).reshape(B, Hkv, group * Sq, D)
    k_heads = k.transpose(1, 2)  # (B, Hkv, Sk, D), a strided view: no copy
    v_heads = v.transpose(1, 2)

    if masked and _every_key_visible(q_pos, kv_pos, causal, window):
        masked = False  # e.g. a decode step: the query comes after every cached key
    if not masked:
        if use_flash:
            out_rows, lse_rows = _flash_block(q_rows, k_heads, v_heads, None, scale)
        else:
            out_rows, lse_rows = _matmul_attention(q_rows, k_heads, v_heads, None, scale, softcap=softcap)
    else:
        out_rows, lse_rows = _masked_attention(
            q_rows, k_heads, v_heads, q_pos, kv_pos, causal, window, scale, group, use_flash, softcap
        )

    out = out_rows.view(B, Hkv, group, Sq, Dv).permute(0, 3, 1, 2, 4).reshape(B, Sq, Hq, Dv)
    lse = lse_rows.reshape(B, Hq, Sq)
    return out.to(q.dtype, memory_format=torch.contiguous_format), lse.to(lse_dtype, memory_format=torch.contiguous_format)


def _triton_decode_module():
    """treeattn.ops.triton_decode, or None when triton is missing (ops.kernels): CUDA attention then
    runs the generic path."""
    return optional_kernel("triton_decode")


def _masked_attention(q_rows, k_heads, v_heads, q_pos, kv_pos, causal, window, scale, group, use_flash, softcap=None):
    """Chunk the keys (and the queries, for long Sq) so the mask never exceeds one block."""
    if use_flash and causal and window is None:
        q_start, kv_start = _arange_start(q_pos), _arange_start(kv_pos)
        if q_start is not None and kv_start is not None and q_start >= kv_start:
            return _contiguous_causal_attention(q_rows, k_heads, v_heads, q_start - kv_start, scale, group)
    B, Hkv, _, _ = q_rows.shape
    Sq = q_pos.shape[1]
    Sk = kv_pos.shape[1]
    key_chunk = MASKED_CHUNK_KEYS
    query_block = max(1, min(Sq, MAX_SCORE_ELEMENTS // (key_chunk * group)))
    outs, lses = [], []
    for q0 in range(0, Sq, query_block):
        q1 = min(Sq, q0 + query_block)
        qp = q_pos[:, q0:q1]
        rows = q_rows.view(B, Hkv, group, Sq, -1)[:, :, :, q0:q1].reshape(B, Hkv, group * (q1 - q0), -1)
        state = None
        for k0 in range(0, Sk, key_chunk):
            k1 = min(Sk, k0 + key_chunk)
            kp = kv_pos[:, k0:k1]
            visible = _visibility(qp, kp, causal, window)  # (B or 1, sq, sk) bool
            seen = visible.any(dim=1).any(dim=0).nonzero()  # keys some query of the block sees
            if seen.numel() == 0:
                continue
            # Only the span of keys the block sees: under a sliding window a block of queries sees about
            # window + its length keys of a chunk's, and the keys outside would be masked work.
            lo, hi = int(seen[0]), int(seen[-1]) + 1
            visible = visible[..., lo:hi]
            bias = None
            if not bool(visible.all()):
                bias = visible
            kc, vc = k_heads[:, :, k0 + lo : k0 + hi], v_heads[:, :, k0 + lo : k0 + hi]
            if use_flash:
                o, s = _flash_block(rows, kc, vc, bias, scale, group)
            else:
                o, s = _matmul_attention(rows, kc, vc, bias, scale, group, softcap)
            state = (o, s) if state is None else _merge_rows(state, (o, s))
        if state is None:
            n_rows = group * (q1 - q0)
            state = (
                torch.zeros(B, Hkv, n_rows, v_heads.shape[-1], dtype=torch.float32, device=q_rows.device),
                torch.full((B, Hkv, n_rows), float("-inf"), dtype=torch.float32, device=q_rows.device),
            )
        outs.append(state[0].view(B, Hkv, group, q1 - q0, -1))
        lses.append(state[1].view(B, Hkv, group, q1 - q0))
    out = torch.cat(outs, dim=3).reshape(B, Hkv, group * Sq, -1)
    lse = torch.cat(lses, dim=3).reshape(B, Hkv, group * Sq)
    return out, lse


def _every_key_visible(q_pos: torch.Tensor, kv_pos: torch.Tensor, causal: bool, window: int | None) -> bool:
    """True when no key is masked for any query: two reductions over the positions, far cheaper
    than the attention they let run without a mask."""
    if causal and bool(kv_pos.max() > q_pos.min()):
        return False
    return window is None or bool(q_pos.max() - kv_pos.min() < window)


def _arange_start(pos: torch.Tensor) -> int | None:
    """If every row of pos (B or 1, S) is start, start + 1, ..., return start; else None."""
    start = pos[:, :1]
    if pos.shape[1] == 0 or not bool((pos == start).all(dim=0)[0]):
        return None
    if not bool((pos == start + torch.arange(pos.shape[1], device=pos.device)).all()):
        return None
    return int(start[0, 0])


def _contiguous_causal_attention(q_rows, k_heads, v_heads, offset, scale, group):
    """Causal attention when query i sits at position offset + i and key j at position j.

    Query block [i0, i1) sees keys [0, i0 + offset) in full (one unmasked call over all its
    GQA-folded rows) and keys [i0 + offset, i1 + offset) through a top-left-aligned causal block
    (one call per query head of the group, with the kernel's own causal masking). No mask tensor
    is ever built, and keys after the block's last query are never touched.
    """
    B, Hkv, R, D = q_rows.shape
    Sq, Sk = R // group, k_heads.shape[2]
    Dv = v_heads.shape[-1]
    by_head = q_rows.view(B, Hkv, group, Sq, D)
    block = CAUSAL_QUERY_BLOCK if q_rows.device.type == "cpu" else max(Sq, 1)
    out = torch.empty(B, Hkv, group, Sq, Dv, dtype=torch.float32, device=q_rows.device)
    lse = torch.empty(B, Hkv, group, Sq, dtype=torch.float32, device=q_rows.device)
    for i0 in range(0, Sq, block):
        i1 = min(Sq, i0 + block)
        n = i1 - i0
        full_end = min(Sk, i0 + offset)
        state = None
        if full_end > 0:
            rows = by_head[:, :, :, i0:i1].reshape(B, Hkv, group * n, D)
            o, s = _flash_block(rows, k_heads[:, :, :full_end], v_heads[:, :, :full_end], None, scale)
            state = (o, s)
        if full_end < Sk:
            diagonal_k, diagonal_v = k_heads[:, :, full_end : i1 + offset], v_heads[:, :, full_end : i1 + offset]
            per_head = [
                _fused_flash(by_head[:, :, g, i0:i1], diagonal_k, diagonal_v, is_causal=True, scale=scale) for g in range(group)
            ]
            o = torch.stack([o.float() for o, _ in per_head], dim=2).reshape(B, Hkv, group * n, Dv)
            s = torch.stack([s for _, s in per_head], dim=2).reshape(B, Hkv, group * n)
            state = (o, s) if state is None else _merge_rows(state, (o, s))
        out[:, :, :, i0:i1] = state[0].view(B, Hkv, group, n, Dv)
        lse[:, :, :, i0:i1] = state[1].view(B, Hkv, group, n)
    return out.view(B, Hkv, R, Dv), lse.view(B, Hkv, R)


def _visibility(q_pos: torch.Tensor, kv_pos: torch.Tensor, causal: bool, window: int | None) -> torch.Tensor:
    """Bool (B or 1, Sq, Sk): key j visible to query i."""
    diff = q_pos.unsqueeze(-1) - kv_pos.unsqueeze(-2)  # q_pos - kv_pos
    visible = torch.ones_like(diff, dtype=torch.bool)
    if causal:
        visible &= diff >= 0
    if window is not None:
        visible &= diff < window
    return visible


def _merge_rows(a, b):
    """merge_states on row-folded states: out (B, Hkv, R, Dv), lse (B, Hkv, R)."""
    # Row-folded layout is a (batch=B, Sq=Hkv, Hq=R) state after a transpose of lse.
    out, lse = merge_states(a[0], a[1].transpose(1, 2), b[0], b[1].transpose(1, 2))
    return out, lse.transpose(1, 2)


def _row_mask(visible: torch.Tensor, group: int) -> torch.Tensor:
    """(B or 1, sq, sk) -> (B or 1, 1, group * sq, sk), rows ordered (g, i) like q_rows."""
    b, sq, sk = visible.shape
    return visible.unsqueeze(1).expand(b, group, sq, sk).reshape(b, 1, group * sq, sk)


def _fused_flash_takes(q: torch.Tensor, D: int, Dv: int, rows_per_kv_head: int) -> bool:
    """Whether torch's fused flash kernel (CPU, or CUDA on sm80+) runs these blocks.

    CPU: every dtype but float64, when D == Dv; float32 decode-sized blocks prefer the matmul path.
    CUDA: float16/bfloat16, D == Dv, D a multiple of 8 up to 256, compute capability >= 8.0. The
    CUDA kernel takes no mask: only unmasked blocks and the causal blocks of contiguous positions
    (prefill, ring-attention blocks) use it; other masked blocks use the matmul path.
    """
    if D != Dv or q.dtype == torch.float64:
        return False
    if q.device.type == "cpu":
        return _cpu_flash is not None and not (q.dtype == torch.float32 and _prefer_matmul(rows_per_kv_head))
    if q.device.type == "cuda":
        return (
            _cuda_flash is not None
            and q.dtype in (torch.float16, torch.bfloat16)
            and D % 8 == 0
            and D <= 256
            and torch.cuda.get_device_capability(q.device)[0] >= 8
        )
    return False


def fused_kernel_layout(t: torch.Tensor) -> torch.Tensor:
    """t itself when torch's fused flash kernels read its layout correctly, else a contiguous copy.

    The private ops this module calls trust their inputs' layout (the public
    scaled_dot_product_attention checks and copies first): the CPU kernel reads each row of the
    last dim as one run and silently returns wrong values when stride(-1) != 1 (a slice [..., ::2],
    one half of a stacked (..., D, 2) tensor, a stride-0 expanded last dim); the CUDA kernel also
    loads 16-byte vectors, so its data pointer and every other stride must be 16-byte aligned.
    Stride 0 (expanded) and any order in the other dims are read correctly and kept: a cache
    slice, a transposed or an expanded KV costs no copy.
    """
    if t.shape[-1] > 1 and t.stride(-1) != 1:
        return t.contiguous()
    if t.device.type == "cuda":
        vector = 16 // t.element_size()
        if t.data_ptr() % 16 != 0 or any(stride % vector for stride in t.stride()[:-1]):
            return t.contiguous()
    return t


def _fused_flash(q, k, v, *, scale, attn_mask=None, is_causal=False):
    """torch's fused flash-attention op of q's device, returning (out (B, H, L, Dv) in q.dtype, lse (B, H, L) float32).

    q (B, H, L, D), k and v (B, H, S, D), any layout (fused_kernel_layout copies the ones the
    kernels misread; attention() has already done so once per call); is_causal aligns top-left.
    The CUDA op takes no attn_mask (callers pass masked blocks elsewhere).
    """
    q, k, v = fused_kernel_layout(q), fused_kernel_layout(k), fused_kernel_layout(v)
    if q.device.type == "cuda":
        if attn_mask is not None:
            raise ValueError("the CUDA flash kernel takes no attn_mask")
        out, lse = _cuda_flash(q, k, v, 0.0, is_causal, False, scale=scale)[:2]
        return out, lse
    return _cpu_flash(q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale)


def _flash_block(q_rows, k_heads, v_heads, visible, scale, group=1):
    """torch's fused flash kernel on one block. Returns float32 out (B, Hkv, R, Dv), lse (B, Hkv, R)."""
    if visible is not None and q_rows.device.type == "cuda":
        return _matmul_attention(q_rows, k_heads, v_heads, visible, scale, group)
    mask = None
    if visible is not None:
        row_visible = _row_mask(visible, group)
        mask = torch.zeros(row_visible.shape, dtype=q_rows.dtype, device=q_rows.device)
        mask.masked_fill_(~row_visible, float("-inf"))
    out, lse = _fused_flash(q_rows, k_heads, v_heads, attn_mask=mask, scale=scale)
    out = out.float()
    if visible is not None:
        # The kernel reports lse = 0 for a row that sees no key; the convention is -inf.
        empty = ~row_visible.any(dim=-1)  # (b, 1, R)
        if bool(empty.any()):
            lse = lse.masked_fill(empty, float("-inf"))
            out = out.masked_fill(empty.unsqueeze(-1), 0.0)
    return out, lse


def _matmul_attention(q_rows, k_heads, v_heads, visible, scale, group=1, softcap=None):
    """Float32 (float64 for float64 inputs) matmul-softmax-matmul over key chunks with an online
    softmax: a running max, sum and unnormalized output, rescaled as each chunk arrives.
    softcap c: scores s become c * tanh(s / c) where they are formed (before masking).

    Returns out (B, Hkv, R, Dv) and lse (B, Hkv, R) in the accumulation dtype.
    """
    acc = torch.float64 if q_rows.dtype == torch.float64 else torch.float32
    B, Hkv, R, _ = q_rows.shape
    Sk, Dv = k_heads.shape[2], v_heads.shape[-1]
    rows = max(1, B * Hkv * R)
    chunk = max(1, min(MAX_SCORE_ELEMENTS // rows, max(256, CACHE_SCORE_ELEMENTS // rows)))
    row_visible = _row_mask(visible, group) if visible is not None else None
    q_scaled = q_rows.to(acc) * scale
    running_max = torch.full((B, Hkv, R, 1), float("-inf"), dtype=acc, device=q_rows.device)
    running_sum = torch.zeros(B, Hkv, R, 1, dtype=acc, device=q_rows.device)
    out = torch.zeros(B, Hkv, R, Dv, dtype=acc, device=q_rows.device)
    for k0 in range(0, Sk, chunk):
        k1 = min(Sk, k0 + chunk)
        scores = torch.matmul(q_scaled, k_heads[:, :, k0:k1].to(acc).transpose(-1, -2))
        if softcap is not None:
            scores = softcap_scores(scores, softcap)
        if row_visible is not None:
            scores.masked_fill_(~row_visible[..., k0:k1], float("-inf"))
        new_max = torch.maximum(running_max, scores.amax(dim=-1, keepdim=True))
        safe_max = torch.where(torch.isneginf(new_max), torch.zeros_like(new_max), new_max)
        probs = torch.exp(scores - safe_max)
        correction = torch.exp(running_max - safe_max)  # 0 while nothing was visible
        running_sum = running_sum * correction + probs.sum(dim=-1, keepdim=True)
        out = torch.baddbmm(
            (out * correction).view(-1, R, Dv), probs.view(-1, R, k1 - k0), v_heads[:, :, k0:k1].to(acc).reshape(-1, k1 - k0, Dv)
        ).view(B, Hkv, R, Dv)
        running_max = new_max
    safe_max = torch.where(torch.isneginf(running_max), torch.zeros_like(running_max), running_max)
    out = out / torch.where(running_sum > 0, running_sum, torch.ones_like(running_sum))
    lse = (safe_max + torch.log(running_sum)).squeeze(-1)  # log(0) = -inf: no visible key
    return out, lse


def softcap_scores(scores: torch.Tensor, softcap: float) -> torch.Tensor:
    """Logit soft-capping (Gemma 2): softcap * tanh(scores / softcap), same shape and dtype."""
    return torch.tanh(scores / softcap) * softcap


def _prefer_matmul(rows_per_kv_head: int) -> bool:
    """For decode-sized row counts (<= 64 query rows per KV head) the online-softmax matmul path
    over cache-sized key chunks beats the fused kernel, on one thread and on two (measured on an
    idle 2-core x86_64: 64K keys, D = 128, 2 threads: MHA 40 ms vs 65 ms, Hq/Hkv = 32/8 29 ms vs
    35 ms; benchmarks/retired/attention_cpu.py, docs/benchmarks.md). Longer query blocks (prefill) keep
    the fused kernel.
    """
    return rows_per_kv_head <= 64
