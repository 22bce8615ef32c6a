"""The float64 naive reference of linear attention: the full S x S kernel matrix, for tests only."""

from __future__ import annotations

import torch

from treeattn.linear.feature_maps import resolve_feature_map


def reference_linear_attention(q, k, v, *, feature_map="elu", causal: bool = True, initial_state=None) -> torch.Tensor:
    """out (B, S, Hq, Dv) float64: phi(q) applied to the float64 inputs, A = phi(Q) phi(K)^T (masked to
    s <= t when causal), out = (A V + phi(Q) S0) / (A 1 + phi(Q) z0); 0 where the denominator is 0."""
    phi_q, phi_k, _ = resolve_feature_map(feature_map)
    q, k, v = q.double(), k.double(), v.double()
    B, S, Hq, _ = q.shape
    Hkv = k.shape[2]
    G = Hq // Hkv
    fq = phi_q(q).double()                                          # (B, S, Hq, F)
    fk = phi_k(k).double().repeat_interleave(G, dim=2)              # (B, S, Hq, F)
    vv = v.repeat_interleave(G, dim=2)
    scores = torch.einsum("bthf,bshf->bhts", fq, fk)
    if causal:
        scores = scores * torch.ones(S, S, dtype=torch.float64).tril()
    num = torch.einsum("bhts,bshd->bthd", scores, vv)
    den = scores.sum(-1).transpose(1, 2)[..., None]                 # (B, S, Hq, 1)
    if initial_state is not None:
        kv0 = initial_state[0].double().repeat_interleave(G, dim=1)  # (B, Hq, F, Dv)
        z0 = initial_state[1].double().repeat_interleave(G, dim=1)   # (B, Hq, F)
        num = num + torch.einsum("bthf,bhfd->bthd", fq, kv0)
        den = den + torch.einsum("bthf,bhf->bth", fq, z0)[..., None]
    safe = torch.where(den > 0, den, torch.ones_like(den))
    return torch.where(den > 0, num / safe, torch.zeros_like(num))
