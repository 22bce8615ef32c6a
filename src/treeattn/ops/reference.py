"""A naive float64 attention, the oracle every test compares against."""

from __future__ import annotations

import torch

from treeattn.ops.validation import check_qkv, check_window_is_causal


def reference_attention(
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
    """Materialize every score in float64 and softmax them. Same contract as ta.attention,
    but returns float64 out (B, Sq, Hq, Dv) and float64 lse (B, Hq, Sq). Small inputs only.
    softcap c: every score s becomes c * tanh(s / c) before masking and softmax.

    Example (the float64 oracle the tests check every method against)::

        >>> import torch, treeattn as ta
        >>> q, k, v = torch.randn(1, 3, 4, 16), torch.randn(1, 8, 2, 16), torch.randn(1, 8, 2, 16)
        >>> out, lse = ta.reference_attention(q, k, v, causal=True)          # query i at position 5 + i
        >>> out.dtype, out.shape, lse.shape
        (torch.float64, torch.Size([1, 3, 4, 16]), torch.Size([1, 4, 3]))
    """
    B, Sq, Sk, Hq, Hkv, D, _ = check_qkv(q, k, v)
    check_window_is_causal(window, causal)
    scale = D ** -0.5 if scale is None else scale
    group = Hq // Hkv
    qd, kd, vd = q.double(), k.double().repeat_interleave(group, 2), v.double().repeat_interleave(group, 2)
    scores = torch.einsum("bihd,bjhd->bhij", qd, kd) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    if causal:
        kp = torch.arange(Sk) if kv_pos is None else kv_pos
        qp = torch.arange(Sq) + (Sk - Sq) if q_pos is None else q_pos
        kp = kp.to(scores.device).reshape(-1, 1, 1, Sk) if kp.dim() == 2 else kp.to(scores.device).view(1, 1, 1, Sk)
        qp = qp.to(scores.device).reshape(-1, 1, Sq, 1) if qp.dim() == 2 else qp.to(scores.device).view(1, 1, Sq, 1)
        visible = torch.ones(1, 1, 1, 1, dtype=torch.bool, device=scores.device)
        if causal:
            visible = visible & (kp <= qp)
        if window is not None:
            visible = visible & (qp - kp < window)
        scores = scores.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # (B, Hq, Sq); -inf where nothing is visible
    safe = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)
    probs = torch.exp(scores - safe.unsqueeze(-1))
    out = torch.einsum("bhij,bjhe->bihe", probs, vd)
    return out, lse
