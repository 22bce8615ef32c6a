"""Linear attention on one device, chunked, and its state: the associative part of the algorithm.

With a feature map phi, the output of query t is

    out_t = phi(q_t) . S_t / (phi(q_t) . z_t),   S_t = sum_s phi(k_s) v_s^T,  z_t = sum_s phi(k_s)

summed over the keys query t may see (all of them, or s <= t when causal). The pair (S, z) of a
span of keys is its *state*; the state of a concatenation is the sum of the states, so spans
combine by addition in any grouping: chunks on one device here, ranks in treeattn.linear.parallel,
a decode step continuing from a prefill's state.

The causal computation walks the sequence in chunks of C tokens: inside a chunk a C x C block
phi(Q) phi(K)^T (lower triangle) handles the chunk's own keys, the running state handles all keys
before the chunk. Memory is O(C^2 + F * Dv) per head, never S x S.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from treeattn.linear.feature_maps import FeatureMap, accumulation_dtype

DEFAULT_CHUNK = 64


class LinearAttentionState(NamedTuple):
    """The state of a span of keys, per batch row and KV head, in the accumulation dtype.

    kv: (B, Hkv, F, Dv) sum over the span of phi(k) v^T.
    k_sum: (B, Hkv, F) sum over the span of phi(k).

    Its size does not depend on the span's length: this is what a linear-attention layer keeps per
    sequence instead of a KV-cache row per token. States add: (a + b) is the state of the two spans.
    """

    kv: torch.Tensor
    k_sum: torch.Tensor

    def __add__(self, other: "LinearAttentionState") -> "LinearAttentionState":  # type: ignore[override]
        return LinearAttentionState(self.kv + other.kv, self.k_sum + other.k_sum)

    @staticmethod
    def zeros(B: int, Hkv: int, F: int, Dv: int, *, dtype: torch.dtype = torch.float32,
              device: torch.device | str = "cpu") -> "LinearAttentionState":
        """The state of an empty span (the identity of +)."""
        return LinearAttentionState(torch.zeros(B, Hkv, F, Dv, dtype=dtype, device=device),
                                    torch.zeros(B, Hkv, F, dtype=dtype, device=device))

    @property
    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size() + self.k_sum.numel() * self.k_sum.element_size()


def heads_first(phi_q: torch.Tensor, phi_k: torch.Tensor, v: torch.Tensor, Hkv: int):
    """(B, S, Hq, F), (B, S, Hkv, F), (B, S, Hkv, Dv) -> (B, Hkv, G, S, F), (B, Hkv, S, F), (B, Hkv, S, Dv).

    Grouped-query attention folded as in ops.attention: the G query heads of KV head h are axis 2."""
    B, S, Hq, F = phi_q.shape
    G = Hq // Hkv
    return phi_q.view(B, S, Hkv, G, F).permute(0, 2, 3, 1, 4), phi_k.transpose(1, 2), v.transpose(1, 2)


def span_state(phi_k: torch.Tensor, v: torch.Tensor) -> LinearAttentionState:
    """The state of a span: phi_k (B, S, Hkv, F) and v (B, S, Hkv, Dv), both in the accumulation dtype."""
    pk, vv = phi_k.transpose(1, 2), v.transpose(1, 2)
    return LinearAttentionState(pk.transpose(-1, -2) @ vv, pk.sum(dim=2))


def chunked_linear_attention(
    phi_q: torch.Tensor,
    phi_k: torch.Tensor,
    v: torch.Tensor,
    initial: LinearAttentionState,
    *,
    causal: bool,
    chunk: int = DEFAULT_CHUNK,
) -> tuple[torch.Tensor, LinearAttentionState]:
    """The kernel: outputs of phi_q over `initial` plus the keys phi_k, and the state after them.

    Args:
        phi_q: (B, S, Hq, F), phi_k: (B, S, Hkv, F), v: (B, S, Hkv, Dv), all in one accumulation
            dtype (float32 or float64); Hq % Hkv == 0.
        initial: the state of the keys before this span (every query sees them).
        causal: query t sees keys s <= t of the span; else every key of the span.
        chunk: tokens per block of the causal walk.

    Returns:
        out (B, S, Hq, Dv) in the accumulation dtype (0 for a row whose denominator is 0: it sees no
        key, or relu mapped it to 0), and the state of initial + the whole span.
    """
    B, S, Hq, F = phi_q.shape
    Hkv, Dv = phi_k.shape[2], v.shape[3]
    G = Hq // Hkv
    pq, pk, vv = heads_first(phi_q, phi_k, v, Hkv)
    kv, z = initial.kv, initial.k_sum
    if not causal:
        kv = kv + pk.transpose(-1, -2) @ vv
        z = z + pk.sum(dim=2)
        num = pq @ kv.unsqueeze(2)                       # (B, Hkv, G, S, Dv)
        den = pq @ z[:, :, None, :, None]                # (B, Hkv, G, S, 1)
    else:
        nums, dens = [], []
        for start in range(0, S, chunk):
            qc, kc, vc = pq[:, :, :, start:start + chunk], pk[:, :, start:start + chunk], vv[:, :, start:start + chunk]
            scores = (qc @ kc.transpose(-1, -2).unsqueeze(2)).tril()  # (B, Hkv, G, c, c): phi(q_i).phi(k_j), j <= i
            nums.append(qc @ kv.unsqueeze(2) + scores @ vc.unsqueeze(2))
            dens.append(qc @ z[:, :, None, :, None] + scores.sum(dim=-1, keepdim=True))
            kv = kv + kc.transpose(-1, -2) @ vc
            z = z + kc.sum(dim=2)
        acc = phi_q.dtype
        num = torch.cat(nums, dim=3) if nums else torch.zeros(B, Hkv, G, 0, Dv, dtype=acc, device=phi_q.device)
        den = torch.cat(dens, dim=3) if dens else torch.zeros(B, Hkv, G, 0, 1, dtype=acc, device=phi_q.device)
    visible = den > 0
    out = torch.where(visible, num / torch.where(visible, den, torch.ones_like(den)), torch.zeros_like(num))
    out = out.permute(0, 3, 1, 2, 4).reshape(B, S, Hq, Dv)
    return out, LinearAttentionState(kv, z)


def apply_feature_maps(q, k, v, phi_q: FeatureMap, phi_k: FeatureMap):
    """phi(q), phi(k) and v in the accumulation dtype, with the shapes the kernel needs checked."""
    acc = accumulation_dtype(q.dtype)
    fq, fk = phi_q(q), phi_k(k)
    for name, t, x in (("phi(q)", fq, q), ("phi(k)", fk, k)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4 or tuple(t.shape[:3]) != tuple(x.shape[:3]):
            got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"feature_map must map (B, S, H, D) to (B, S, H, F); {name} has shape {got} for input "
                             f"{tuple(x.shape)}")
    if fq.shape[3] != fk.shape[3]:
        raise ValueError(f"feature_map: phi(q) and phi(k) must have the same F, got {fq.shape[3]} and {fk.shape[3]}")
    if fq.shape[3] == 0:
        raise ValueError("feature_map: F (the feature dimension) must be positive, got 0")
    return fq.to(acc), fk.to(acc), v.to(acc)
