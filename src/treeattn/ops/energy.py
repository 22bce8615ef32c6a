"""The energy view of attention (Tree Attention paper, section 4).

For one query row, F(zeta) = logsumexp_j(scale * q.k_j + zeta.v_j). Its value at zeta = 0 is the
attention logsumexp, and its gradient there is the softmax-weighted mean of the values: attention
itself. Because logsumexp is associative, so is everything attention needs, which is why the
reduction over a sequence-sharded KV cache can run as a tree.
"""

from __future__ import annotations

import torch

from treeattn.ops.validation import check_qkv, check_scale


def energy(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, zeta: torch.Tensor, *, scale: float | None = None
) -> torch.Tensor:
    """The energy F(zeta) = logsumexp over keys of (scale * q.k + zeta.v), differentiable in zeta.

    Args:
        q: (B, Sq, Hq, D); k: (B, Sk, Hkv, D); v: (B, Sk, Hkv, Dv); Hq % Hkv == 0.
        zeta: (B, Sq, Hq, Dv), the source variable coupled to the values.
        scale: default D ** -0.5.

    Returns:
        (B, Hq, Sq) in float32 (float64 for float64 inputs). This is the naive O(Sq * Sk) form,
        meant for checking the theory, not for long sequences.

    Example (at zeta = 0 the energy is the logsumexp of the scores: attention's lse)::

        >>> import torch, treeattn as ta
        >>> q = torch.randn(1, 1, 4, 16, dtype=torch.float64)
        >>> k, v = torch.randn(1, 10, 2, 16, dtype=torch.float64), torch.randn(1, 10, 2, 16, dtype=torch.float64)
        >>> f = ta.energy(q, k, v, torch.zeros(1, 1, 4, 16, dtype=torch.float64))   # (B, Hq, Sq)
        >>> f.shape, torch.allclose(f, ta.attention(q, k, v)[1])
        (torch.Size([1, 4, 1]), True)
    """
    B, Sq, Sk, Hq, Hkv, D, Dv = check_qkv(q, k, v)
    scale = check_scale(scale, D)
    if not isinstance(zeta, torch.Tensor):
        raise TypeError(f"zeta must be a tensor, got {type(zeta).__name__}")
    if tuple(zeta.shape) != (B, Sq, Hq, Dv):
        raise ValueError(f"zeta must have shape (B, Sq, Hq, Dv) = {(B, Sq, Hq, Dv)}, got {tuple(zeta.shape)}")
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    group = Hq // Hkv
    k_full = k.to(acc).repeat_interleave(group, dim=2)  # (B, Sk, Hq, D)
    v_full = v.to(acc).repeat_interleave(group, dim=2)
    scores = torch.einsum("bihd,bjhd->bhij", q.to(acc), k_full) * scale
    scores = scores + torch.einsum("bihe,bjhe->bhij", zeta.to(acc), v_full)
    return torch.logsumexp(scores, dim=-1)


def attention_via_energy(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float | None = None
) -> torch.Tensor:
    """Attention as the autograd gradient of the energy at zeta = 0.

    Returns:
        out: (B, Sq, Hq, Dv) in q.dtype, equal to ta.attention(q, k, v, scale=scale)[0].

    Example::

        >>> import torch, treeattn as ta
        >>> q = torch.randn(1, 1, 4, 16, dtype=torch.float64)
        >>> k, v = torch.randn(1, 10, 2, 16, dtype=torch.float64), torch.randn(1, 10, 2, 16, dtype=torch.float64)
        >>> torch.allclose(ta.attention_via_energy(q, k, v), ta.attention(q, k, v)[0])
        True
    """
    B, Sq, Sk, Hq, Hkv, D, Dv = check_qkv(q, k, v)
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    zeta = torch.zeros(B, Sq, Hq, Dv, dtype=acc, device=q.device, requires_grad=True)
    with torch.enable_grad():
        f = energy(q.detach(), k.detach(), v.detach(), zeta, scale=scale)
        (grad,) = torch.autograd.grad(f.sum(), zeta)
    return grad.to(q.dtype)
