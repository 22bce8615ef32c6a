"""Attention that never synchronizes with the host: the local part of a CUDA-graph-safe decode step.

treeattn.ops.attention chooses its path from the data (is every key visible? are the positions one
contiguous range? does a chunk see any key?). Each such test reads a device value on the host; on
a GPU that stalls the stream, and inside CUDA-graph capture it is an error. graph_safe_attention
makes no choice that depends on tensor values:

- CUDA tensors: the Triton flash-decoding kernel (treeattn.ops.triton_decode). With `kv_len` it
  runs the kernel's paged entry point with a one-block-per-sequence table, so slots past kv_len[b]
  are never read, and kv_len is read on the device. When the kernel cannot take the inputs
  (triton missing, dtype, head dim, more than 16 queries) it raises instead of falling back: the
  generic path would synchronize.
- Other devices: a float32 matmul-softmax-matmul with an online softmax over key chunks and a
  visibility mask built on the device from the positions and kv_len. It reads every key, so over
  a mostly empty buffer it is slower than ops.attention; it exists to run the graph-safe decode
  step eagerly on the CPU (tests, reference).
"""

from __future__ import annotations

import torch

from treeattn.ops.attention import _matmul_attention, _triton_decode_module
from treeattn.ops.validation import check_positions, check_qkv, check_scale, check_softcap


def graph_safe_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float | None = None,
    q_pos: torch.Tensor | None = None,
    kv_pos: torch.Tensor | None = None,
    kv_len: torch.Tensor | None = None,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact attention, causal by positions, with no host synchronization.

    Args:
        q: (B, Sq, Hq, D) float32, float16, bfloat16 (float64 off CUDA). On CUDA 1 <= Sq <= 16.
        k: (B, Sk, Hkv, D), same dtype and device, any strides; Hq % Hkv == 0. Sk may be 0.
        v: (B, Sk, Hkv, Dv).
        scale: softmax scale, default D ** -0.5.
        q_pos: int64 (Sq,) or (B, Sq); kv_pos: int64 (Sk,) or (B, Sk). Both or neither: with them
            key j is visible to query i iff kv_pos[j] <= q_pos[i]; without, every key is.
        kv_len: int32/int64 (B,) on q's device, or None: only keys j < kv_len[b] of sequence b
            exist (a preallocated buffer of which the first kv_len[b] slots are in use). Read on
            the device; values outside [0, Sk] are clamped into it there (checking them on the
            host would synchronize).
        softcap: logit soft-capping c: scores s become c * tanh(s / c); None: none.

    Returns:
        out: (B, Sq, Hq, Dv) in q.dtype; lse: (B, Hq, Sq) float32 (float64 for float64 inputs). A
        row that sees no key has out = 0 and lse = -inf.

    Raises:
        ValueError / TypeError: bad inputs; on CUDA also inputs the Triton kernel does not take.
        RuntimeError: CUDA tensors without triton installed.
    """
    B, Sq, Sk, Hq, Hkv, D, Dv = check_qkv(q, k, v)
    scale = check_scale(scale, D)
    softcap = check_softcap(softcap)
    if (q_pos is None) != (kv_pos is None):
        raise ValueError("q_pos and kv_pos must be given together, got only one of them")
    q_pos = check_positions(q_pos, "q_pos", B, Sq, q.device)
    kv_pos = check_positions(kv_pos, "kv_pos", B, Sk, q.device)
    if kv_len is not None:
        if not isinstance(kv_len, torch.Tensor) or tuple(kv_len.shape) != (B,):
            shape = tuple(kv_len.shape) if isinstance(kv_len, torch.Tensor) else type(kv_len).__name__
            raise ValueError(f"kv_len must be a tensor of shape (B,) = ({B},), got {shape}")
        if kv_len.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"kv_len must be int32 or int64, got {kv_len.dtype}")
        if kv_len.device != q.device:
            raise ValueError(f"kv_len must be on the device of q ({q.device}), got {kv_len.device}")
        kv_len = kv_len.clamp(0, Sk)

    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    if B == 0 or Sq == 0 or Sk == 0:  # nothing to compute: empty, or rows that see no key
        return (
            torch.zeros(B, Sq, Hq, Dv, dtype=q.dtype, device=q.device),
            torch.full((B, Hq, Sq), float("-inf"), dtype=acc, device=q.device),
        )
    if q.device.type == "cuda":
        triton_decode = _triton_decode_module()
        if triton_decode is None:
            raise RuntimeError(
                "graph_safe_attention on CUDA needs the Triton decode kernel, and triton is not installed "
                "(pip install 'treeattn[triton]')"
            )
        return kernel_attention(triton_decode, q, k, v, scale=scale, q_pos=q_pos, kv_pos=kv_pos, kv_len=kv_len, softcap=softcap)
    return _masked_matmul_attention(q, k, v, scale, q_pos, kv_pos, kv_len, softcap)


def kernel_attention(triton_decode, q, k, v, *, scale, q_pos, kv_pos, kv_len, softcap=None):
    """The CUDA branch of graph_safe_attention on validated inputs (Sk > 0, Sq > 0).

    Args:
        triton_decode: the treeattn.ops.triton_decode module (a parameter so that tests can pass
            the module loaded under Triton's interpreter and run this branch on CPU tensors).
        q_pos, kv_pos: int64 (B or 1, S) or both None. kv_len: (B,) already clamped, or None.

    Raises:
        ValueError naming the reason when the kernel does not take the inputs.
    """
    reason = triton_decode.unsupported_reason(q, k, v)
    if reason is not None:
        raise ValueError(
            f"graph-safe attention needs the Triton decode kernel, which does not take {reason}; "
            "the generic path would synchronize with the host"
        )
    causal = q_pos is not None
    if kv_len is None:
        return triton_decode.decode_attention(q, k, v, scale=scale, causal=causal, q_pos=q_pos, kv_pos=kv_pos, softcap=softcap)
    # Sequence b's keys as one block of Sk slots: the pool is k itself, block b is row b.
    B = q.shape[0]
    table = torch.arange(B, dtype=torch.int32, device=q.device).view(B, 1)
    return triton_decode.paged_decode_attention(
        q, k, v, table, kv_len, scale=scale, causal=causal, q_pos=q_pos, kv_pos=kv_pos, softcap=softcap
    )


def _masked_matmul_attention(q, k, v, scale, q_pos, kv_pos, kv_len, softcap=None):
    """Off CUDA: the online-softmax matmul path of ops.attention with the full mask, built on the
    device. Positions are (B or 1, S) int64 or None; kv_len (B,) clamped or None."""
    B, Sq, Hq, D = q.shape
    Sk, Hkv, Dv = k.shape[1], k.shape[2], v.shape[3]
    group = Hq // Hkv
    visible = None  # bool (B or 1, Sq, Sk)
    if q_pos is not None:
        visible = kv_pos.unsqueeze(1) <= q_pos.unsqueeze(2)
    if kv_len is not None:
        exists = (torch.arange(Sk, device=q.device) < kv_len.unsqueeze(1)).unsqueeze(1)  # (B, 1, Sk)
        visible = exists.expand(B, Sq, Sk) if visible is None else visible & exists
    # Fold GQA as ops.attention does: (B, Sq, Hkv, G, D) -> (B, Hkv, G * Sq, D); row r = g * Sq + i.
    q_rows = q.reshape(B, Sq, Hkv, group, D).permute(0, 2, 3, 1, 4).reshape(B, Hkv, group * Sq, D)
    out_rows, lse_rows = _matmul_attention(q_rows, k.transpose(1, 2), v.transpose(1, 2), visible, scale, group, softcap)
    out = out_rows.view(B, Hkv, group, Sq, Dv).permute(0, 3, 1, 2, 4).reshape(B, Sq, Hq, Dv)
    lse = lse_rows.reshape(B, Hq, Sq)
    lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    return out.to(q.dtype, memory_format=torch.contiguous_format), lse.to(lse_dtype, memory_format=torch.contiguous_format)
