"""The attention-state algebra: exact merging of partial attention results.

An attention state over a KV segment A is the pair (o_A, s_A): o_A the softmax-weighted mean of the
segment's values and s_A the logsumexp of its scores. Two states over disjoint segments merge into
the state over their union:

    s = logaddexp(s_A, s_B)
    o = exp(s_A - s) * o_A + exp(s_B - s) * o_B

The merge is associative and commutative, and (0, -inf) -- a segment with no visible key -- is its
identity. Every algorithm in treeattn (chunked attention, tree and ring decoding, bifurcated
attention, the GPU kernel) applies this merge in some order over some partition of the keys.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from treeattn.ops.validation import check_state


def _state_weights(lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For stacked lse values (n, B, Hq, Sq), return the merged lse and each state's weight.

    weight_i = exp(lse_i - lse), computed against the running max so nothing overflows; a group
    whose every member is -inf gets lse = -inf and all-zero weights (never NaN).
    """
    top = lses.amax(dim=0)
    top = torch.where(torch.isneginf(top), torch.zeros_like(top), top)
    scaled = torch.exp(lses - top)
    total = scaled.sum(dim=0)
    merged_lse = top + torch.log(total)  # log(0) = -inf for rows that see no key
    weights = scaled / torch.where(total > 0, total, torch.ones_like(total))
    return merged_lse, weights


def merge_states(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two attention states over disjoint KV segments into the state over their union.

    Args:
        out_a: (B, Sq, Hq, Dv), any float dtype.
        lse_a: (B, Hq, Sq), float32, natural log, softmax scale included. -inf marks a row that saw
            no key; such a state is the identity of the merge.
        out_b, lse_b: the second state, same shapes, dtypes and device.

    Returns:
        (out, lse): out (B, Sq, Hq, Dv) in out_a.dtype, lse (B, Hq, Sq) float32. Computed in
        float32 (float64 if the inputs are float64).

    Example (attention over two segments of the keys, merged, is attention over all of them)::

        >>> import torch, treeattn as ta
        >>> q = torch.randn(1, 1, 4, 32)
        >>> k, v = torch.randn(1, 100, 4, 32), torch.randn(1, 100, 4, 32)
        >>> out_a, lse_a = ta.attention(q, k[:, :60], v[:, :60])             # keys 0..59
        >>> out_b, lse_b = ta.attention(q, k[:, 60:], v[:, 60:])             # keys 60..99
        >>> out, lse = ta.merge_states(out_a, lse_a, out_b, lse_b)
        >>> full, full_lse = ta.attention(q, k, v)
        >>> torch.allclose(out, full, atol=1e-5) and torch.allclose(lse, full_lse, atol=1e-5)
        True
    """
    return merge_states_list([out_a, out_b], [lse_a, lse_b])


def merge_states_list(
    outs: Sequence[torch.Tensor], lses: Sequence[torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge n >= 1 attention states over disjoint KV segments in one float32 pass.

    Args:
        outs: n tensors (B, Sq, Hq, Dv), one float dtype.
        lses: n tensors (B, Hq, Sq), float32.

    Returns:
        (out, lse) as in merge_states. Merging all states at once rounds only once, so it is at
        least as accurate as any sequence of pairwise merges.

    Example (three segments, one merge)::

        >>> import torch, treeattn as ta
        >>> q = torch.randn(1, 2, 4, 32)
        >>> k, v = torch.randn(1, 90, 4, 32), torch.randn(1, 90, 4, 32)
        >>> states = [ta.attention(q, kc, vc) for kc, vc in zip(k.split(30, dim=1), v.split(30, dim=1))]
        >>> out, lse = ta.merge_states_list([o for o, _ in states], [s for _, s in states])
        >>> torch.allclose(out, ta.attention(q, k, v)[0], atol=1e-5)
        True
    """
    outs, lses = list(outs), list(lses)
    if len(outs) == 0 or len(outs) != len(lses):
        raise ValueError(f"outs and lses must be non-empty and of equal length, got {len(outs)} and {len(lses)}")
    for i, (o, s) in enumerate(zip(outs, lses)):
        check_state(o, s, f"state {i}")
        if o.shape != outs[0].shape:
            raise ValueError(f"state {i}: out shape {tuple(o.shape)} differs from state 0's {tuple(outs[0].shape)}")
        if o.dtype != outs[0].dtype:
            raise TypeError(f"state {i}: out dtype {o.dtype} differs from state 0's {outs[0].dtype}")
        if o.device != outs[0].device:
            raise ValueError(f"state {i}: device {o.device} differs from state 0's {outs[0].device}")
    out_dtype = outs[0].dtype
    acc = torch.float64 if out_dtype == torch.float64 else torch.float32
    if len(outs) == 1:
        return outs[0], lses[0].to(acc if acc == torch.float64 else torch.float32)
    merged_lse, weights = _state_weights(torch.stack([s.to(acc) for s in lses]))
    # weights: (n, B, Hq, Sq) -> (n, B, Sq, Hq, 1) to scale the outputs
    weights = weights.permute(0, 1, 3, 2).unsqueeze(-1)
    out = torch.zeros(outs[0].shape, dtype=acc, device=outs[0].device)
    for w, o in zip(weights, outs):
        out.addcmul_(w, o.to(acc))
    return out.to(out_dtype), merged_lse
