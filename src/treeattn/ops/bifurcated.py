"""Bifurcated attention: n samples decoded from one shared context read the context K/V once.

When n completions are sampled from one prompt, every sample's KV cache starts with the same
context. A plain batched decode step reads that context K/V n times, once per sample. Bifurcated
attention (papers/bifurcated-attention.txt, section 4) splits each step's keys into

    context part: the shared context K/V (1, Mc, Hkv, D), one copy for all n samples
    decode part:  each sample's own decoded K/V (n, Md, Hkv, D)

and merges the two attention states exactly with merge_states. The context part folds the n
samples into the row dimension of one matrix product: q (n, Sq, Hq, D) is viewed as one batch row
(1, n * Sq, Hq, D), and treeattn.ops.attention further folds the Hq // Hkv query heads of each KV
head into rows, so every context K/V byte is read once per step for all n samples and all query
heads of its group -- the paper's einsum "bgpnk,gmk->bgpnm" with b moved into the rows.

Positions. With no positions given the layout is the plain one: sample b's keys are the context
at positions 0 .. Mc - 1 followed by its decoded tokens at Mc .. Mc + Md - 1, and query i sits at
Mc + Md - Sq + i (bottom-right, like ta.attention(causal=True)): with Sq > 1 (speculative
decoding) the query tokens are the last Sq decoded entries and see each other causally. With
q_pos given, a key is visible to a query iff key position <= query position; context_pos and
decode_pos default to the plain layout. Samples whose decoded lengths differ are padded to one Md
and given decode_pos entries beyond every query position for the padding, which hides it.

The result equals ta.attention over the concatenation [context, decoded] of each sample, causal,
up to rounding (one extra rounding of the two partial outputs to q.dtype before the merge).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from treeattn.ops.attention import attention
from treeattn.ops.merge import merge_states
from treeattn.ops.validation import FLOAT_DTYPES, check_positions, check_scale

logger = logging.getLogger(__name__)

MODES = ("auto", "bifurcated", "batched")

# The workload-based switch (paper, appendix A, Q4). At or below this many context K elements read
# per step by a plain batch (n * Mc * Hkv * D; as many V), plain batched attention over the
# concatenated [context, decoded] K/V is faster than the split on this machine; above it the split
# wins. Measured on x86_64 (AMD EPYC, 2 cores, AVX-512), CPU-only, torch 2.13.0, float32, Sq = 1,
# MHA (Hq = Hkv = 16) and MQA (Hq = 16, Hkv = 1), D = 64, n 1..64, Mc 16..4096, Md 1 and 64, by
#     flock /tmp/treeattn-bench.lock python benchmarks/kernels/bifurcated.py switch --repeats 20
# Result: "batched iff n * Mc * Hkv * D <= 131072": over the 140 workloads it picks the slower mode
# (by > 5%) 19 times, mean slowdown vs the faster mode 1.045x (always splitting: 55 times, 1.179x).
# An earlier run of the same grid fits 262144; the loss is flat between the two (mean 1.02x-1.05x).
# In model terms: MHA with Hkv * D = 1024 splits above n * Mc = 128, MQA with Hkv * D = 64 above
# n * Mc = 2048. Tables in docs/benchmarks.md, "Bifurcated attention".
AUTO_BATCHED_MAX_CONTEXT_ELEMENTS = 131072


def bifurcated_attention(
    q: torch.Tensor,
    context_k: torch.Tensor,
    context_v: torch.Tensor,
    decode_k: torch.Tensor,
    decode_v: torch.Tensor,
    *,
    scale: float | None = None,
    q_pos: torch.Tensor | None = None,
    context_pos: torch.Tensor | None = None,
    decode_pos: torch.Tensor | None = None,
    mode: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of n samples over one shared context plus each sample's own decoded tokens.

    Args:
        q: (n, Sq, Hq, D) float32, float16, bfloat16 or float64; n >= 1 samples, Sq query tokens
            each (Sq = 1 for plain decoding, > 1 for speculative decoding).
        context_k: (1, Mc, Hkv, D), same dtype and device as q; the context's keys, shared by all
            samples. Hq % Hkv == 0 (MHA, GQA, MQA). Mc may be 0.
        context_v: (1, Mc, Hkv, Dv).
        decode_k: (n, Md, Hkv, D); sample b's keys of the tokens decoded so far (including this
            step's, if the caller has appended them). Md may be 0.
        decode_v: (n, Md, Hkv, Dv).
        scale: softmax scale, default D ** -0.5.
        q_pos: int64 (Sq,) or (n, Sq): absolute positions of the queries. Giving it turns on
            position masking: a key is visible iff its position <= the query's.
        context_pos: int64 (Mc,) or (1, Mc), default 0 .. Mc - 1. Needs q_pos.
        decode_pos: int64 (Md,) or (n, Md), default Mc .. Mc + Md - 1. Needs q_pos.
        mode: "bifurcated" (context read once, then merge), "batched" (the plain batch: context
            copied n times and concatenated with the decoded K/V, one attention call), or
            "auto" (batched for small workloads, where it is faster; see use_bifurcated).

    Returns:
        out: (n, Sq, Hq, Dv) in q.dtype.
        lse: (n, Hq, Sq) float32 (float64 for float64 inputs). A row that sees no key has out = 0
            and lse = -inf.

    Example (4 samples decoding after one shared 200-token context)::

        >>> import torch, treeattn as ta
        >>> q = torch.randn(4, 1, 8, 32)                                             # (n, Sq, Hq, D)
        >>> ck, cv = torch.randn(1, 200, 2, 32), torch.randn(1, 200, 2, 32)          # the shared context, once
        >>> dk, dv = torch.randn(4, 5, 2, 32), torch.randn(4, 5, 2, 32)              # each sample's own tokens
        >>> out, lse = ta.bifurcated_attention(q, ck, cv, dk, dv, mode="bifurcated")
        >>> batched = ta.attention(q, torch.cat([ck.expand(4, -1, -1, -1), dk], 1), torch.cat([cv.expand(4, -1, -1, -1), dv], 1))
        >>> torch.allclose(out, batched[0], atol=1e-5)
        True
    """
    n, Sq, Hq, D, Mc, Md, Hkv, Dv = check_bifurcated_inputs(q, context_k, context_v, decode_k, decode_v)
    scale = check_scale(scale, D)
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    q_pos, context_pos, decode_pos = _resolve_positions(q_pos, context_pos, decode_pos, n, Sq, Mc, Md, q.device)
    if mode == "auto":
        mode = "bifurcated" if use_bifurcated(n, Mc, Hkv, D) else "batched"
    if mode == "batched":
        return _batched(q, context_k, context_v, decode_k, decode_v, scale, q_pos, context_pos, decode_pos)
    return _bifurcated(q, context_k, context_v, decode_k, decode_v, scale, q_pos, context_pos, decode_pos)


def use_bifurcated(n: int, context_len: int, kv_heads: int, head_dim: int) -> bool:
    """The workload-based switch: True where the bifurcated split is expected to be faster.

    A plain batch reads n * context_len * kv_heads * head_dim context K (and as many V) elements a
    step; the split reads 1/n of that but runs two attention calls and a merge. Small workloads
    (short context, few samples) do not amortize the extra call, so they go to the plain batch.
    The threshold AUTO_BATCHED_MAX_CONTEXT_ELEMENTS is measured (see its comment).
    """
    return n * context_len * kv_heads * head_dim > AUTO_BATCHED_MAX_CONTEXT_ELEMENTS


def context_state(
    q: torch.Tensor,
    context_k: torch.Tensor,
    context_v: torch.Tensor,
    *,
    scale: float,
    q_pos: torch.Tensor | None,
    context_pos: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The context part: all n samples' queries against the one shared context K/V.

    Args:
        q: (n, Sq, Hq, D). context_k, context_v: (1, Mc, Hkv, D), (1, Mc, Hkv, Dv).
        q_pos: int64 (1 or n, Sq) or None; context_pos: int64 (1, Mc) or None. With None for
            both, every query sees the whole context (no mask).

    Returns:
        (out, lse): (n, Sq, Hq, Dv) in q.dtype and (n, Hq, Sq) float32.
    """
    n, Sq, Hq, _ = q.shape
    folded_q, folded_pos = fold_samples(q, q_pos)
    if folded_pos is None:
        out, lse = attention(folded_q, context_k, context_v, scale=scale)
    else:
        out, lse = attention(folded_q, context_k, context_v, scale=scale, causal=True, q_pos=folded_pos, kv_pos=context_pos)
    return unfold_samples(out, lse, n, Sq)


def fold_samples(q: torch.Tensor, q_pos: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """View n samples' queries as one batch row: (n, Sq, Hq, D) -> (1, n * Sq, Hq, D).

    q_pos (1 or n, Sq) becomes (1, n * Sq) in the same row order (sample-major); None stays None.
    """
    n, Sq, Hq, D = q.shape
    folded_q = q.reshape(1, n * Sq, Hq, D)
    folded_pos = None if q_pos is None else q_pos.expand(n, Sq).reshape(1, n * Sq)
    return folded_q, folded_pos


def unfold_samples(out: torch.Tensor, lse: torch.Tensor, n: int, Sq: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of fold_samples on a state: out (1, n * Sq, Hq, Dv) -> (n, Sq, Hq, Dv),
    lse (1, Hq, n * Sq) -> (n, Hq, Sq)."""
    Hq, Dv = out.shape[2], out.shape[3]
    return out.reshape(n, Sq, Hq, Dv), lse.reshape(Hq, n, Sq).transpose(0, 1).contiguous()


def decode_state(
    q: torch.Tensor,
    decode_k: torch.Tensor,
    decode_v: torch.Tensor,
    *,
    scale: float,
    q_pos: torch.Tensor | None,
    decode_pos: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The decode part: each sample's queries against its own decoded K/V (ordinary batched attention).

    Args:
        q: (n, Sq, Hq, D). decode_k, decode_v: (n, Md, Hkv, D), (n, Md, Hkv, Dv).
        q_pos: int64 (1 or n, Sq) or None; decode_pos: int64 (1 or n, Md) or None. With None for
            both the queries are the last Sq decoded tokens (bottom-right causal for Sq > 1).

    Returns:
        (out, lse): (n, Sq, Hq, Dv) in q.dtype and (n, Hq, Sq) float32.
    """
    Sq = q.shape[1]
    if q_pos is None:
        return attention(q, decode_k, decode_v, scale=scale, causal=Sq > 1)
    return attention(q, decode_k, decode_v, scale=scale, causal=True, q_pos=_per_batch(q_pos), kv_pos=_per_batch(decode_pos))


def _bifurcated(q, context_k, context_v, decode_k, decode_v, scale, q_pos, context_pos, decode_pos):
    """The split: context part (samples folded into rows) and decode part, merged."""
    Sq, Md = q.shape[1], decode_k.shape[1]
    context_q_pos, context_kv_pos = q_pos, context_pos
    if q_pos is None and Sq > Md + 1:
        # Plain layout with more queries than decoded tokens + 1: the first queries sit inside
        # the context and must not see all of it.
        Mc = context_k.shape[1]
        context_q_pos = (torch.arange(Sq, device=q.device) + (Mc + Md - Sq)).unsqueeze(0)
        context_kv_pos = torch.arange(Mc, device=q.device).unsqueeze(0)
    elif q_pos is not None and context_pos.shape[1] > 0 and int(q_pos.min()) >= int(context_pos.max()):
        context_q_pos, context_kv_pos = None, None  # every query sees the whole context: no mask
    out_c, lse_c = context_state(q, context_k, context_v, scale=scale, q_pos=context_q_pos, context_pos=context_kv_pos)
    if Md == 0:
        return out_c, lse_c
    out_d, lse_d = decode_state(q, decode_k, decode_v, scale=scale, q_pos=q_pos, decode_pos=decode_pos)
    return merge_states(out_c, lse_c, out_d, lse_d)


def _batched(q, context_k, context_v, decode_k, decode_v, scale, q_pos, context_pos, decode_pos):
    """The plain batch: every sample gets its own copy of the context, one attention call."""
    n, Sq = q.shape[0], q.shape[1]
    Mc, Md = context_k.shape[1], decode_k.shape[1]
    keys = torch.cat([context_k.expand(n, -1, -1, -1), decode_k], dim=1)
    values = torch.cat([context_v.expand(n, -1, -1, -1), decode_v], dim=1)
    if q_pos is None:
        # Bottom-right causal over the concatenation is the plain layout; Sq = 1 sees every key.
        return attention(q, keys, values, scale=scale, causal=Sq > 1)
    kv_pos = torch.cat([context_pos.expand(n, Mc), decode_pos.expand(n, Md)], dim=1)
    return attention(q, keys, values, scale=scale, causal=True, q_pos=_per_batch(q_pos), kv_pos=kv_pos)


def _per_batch(pos: torch.Tensor) -> torch.Tensor:
    """(1, S) -> (S,) (shared by every batch row, as ta.attention takes it); (B, S) unchanged."""
    return pos[0] if pos.shape[0] == 1 else pos


def _resolve_positions(q_pos, context_pos, decode_pos, n, Sq, Mc, Md, device):
    """Validate the positions; with q_pos given, fill in the plain layout for the missing ones.

    Returns (q_pos (1 or n, Sq), context_pos (1, Mc), decode_pos (1 or n, Md)), or three Nones.
    """
    if q_pos is None:
        if context_pos is not None or decode_pos is not None:
            given = "context_pos" if context_pos is not None else "decode_pos"
            raise ValueError(f"{given} was given without q_pos; positions mask keys against the query positions, so pass q_pos "
                             f"too")
        return None, None, None
    q_pos = check_positions(q_pos, "q_pos", n, Sq, device)
    context_pos = check_positions(context_pos, "context_pos", 1, Mc, device)
    decode_pos = check_positions(decode_pos, "decode_pos", n, Md, device)
    if context_pos is None:
        context_pos = torch.arange(Mc, device=device).unsqueeze(0)
    if decode_pos is None:
        decode_pos = (torch.arange(Md, device=device) + Mc).unsqueeze(0)
    return q_pos, context_pos, decode_pos


def check_bifurcated_inputs(
    q: torch.Tensor,
    context_k: torch.Tensor,
    context_v: torch.Tensor,
    decode_k: torch.Tensor,
    decode_v: torch.Tensor,
    context_names: tuple[str, str] = ("context_k", "context_v"),
) -> tuple[int, int, int, int, int, int, int, int]:
    """Validate shapes, dtypes and devices; errors name the argument (the context tensors by
    `context_names`). Returns (n, Sq, Hq, D, Mc, Md, Hkv, Dv)."""
    ck_name, cv_name = context_names
    layouts = {
        "q": "(n, Sq, Hq, D)",
        ck_name: "(1, Mc, Hkv, D)",
        cv_name: "(1, Mc, Hkv, Dv)",
        "decode_k": "(n, Md, Hkv, D)",
        "decode_v": "(n, Md, Hkv, Dv)",
    }
    tensors = {"q": q, ck_name: context_k, cv_name: context_v, "decode_k": decode_k, "decode_v": decode_v}
    for name, t in tensors.items():
        if isinstance(t, Sequence) and name.startswith("decode"):
            shapes = [tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__ for x in t]
            raise TypeError(
                f"{name} must be one tensor {layouts[name]}, got a {type(t).__name__} of {len(t)} per-sample "
                f"entries (shapes {shapes}); pad the samples to one length Md and pass q_pos and decode_pos, "
                "giving the padding positions beyond every query position so it is masked"
            )
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor {layouts[name]}, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must have 4 dims {layouts[name]}, got shape {tuple(t.shape)}")
        if t.dtype not in FLOAT_DTYPES:
            raise TypeError(f"{name} must be float32, float16, bfloat16 or float64, got {t.dtype}")
        if t.dtype != q.dtype:
            raise TypeError(f"{name} must have the dtype of q ({q.dtype}), got {t.dtype}")
        if t.device != q.device:
            raise ValueError(f"{name} must be on the device of q ({q.device}), got {t.device}")
    n, Sq, Hq, D = q.shape
    if n == 0:
        raise ValueError(f"q must hold at least one sample: expected n >= 1 in shape (n, Sq, Hq, D), got {tuple(q.shape)}")
    for name in (ck_name, cv_name):
        if tensors[name].shape[0] != 1:
            raise ValueError(
                f"{name} must have batch 1 (one context shared by all samples), shape {layouts[name]}, "
                f"got {tuple(tensors[name].shape)}"
            )
    for name in ("decode_k", "decode_v"):
        if tensors[name].shape[0] != n:
            raise ValueError(f"{name} must have one row per sample, n = {n} (from q), got shape {tuple(tensors[name].shape)}")
    Hkv = context_k.shape[2]
    for name in (cv_name, "decode_k", "decode_v"):
        if tensors[name].shape[2] != Hkv:
            raise ValueError(
                f"{name} must have the KV head count of {ck_name} (Hkv = {Hkv}), got Hkv = {tensors[name].shape[2]} "
                f"(shape {tuple(tensors[name].shape)})"
            )
    if Hq == 0 or Hkv == 0:
        raise ValueError(
            f"head counts must be positive, got Hq={Hq} (q shape {tuple(q.shape)}) and Hkv={Hkv} ({ck_name} shape "
            f"{tuple(context_k.shape)})"
        )
    if Hq % Hkv != 0:
        raise ValueError(
            f"Hq must be a multiple of Hkv (MHA, GQA, MQA), got Hq = {Hq} (q {tuple(q.shape)}) and "
            f"Hkv = {Hkv} ({ck_name} {tuple(context_k.shape)})"
        )
    for name in (ck_name, "decode_k"):
        if tensors[name].shape[3] != D:
            raise ValueError(f"{name} must have the head dim of q (D = {D}), got shape {tuple(tensors[name].shape)}")
    Dv = context_v.shape[3]
    if decode_v.shape[3] != Dv:
        raise ValueError(f"decode_v must have the value head dim of {cv_name} (Dv = {Dv}), got shape {tuple(decode_v.shape)}")
    if D == 0 or Dv == 0:
        raise ValueError(f"head dims must be positive, got D={D}, Dv={Dv}")
    Mc, Md = context_k.shape[1], decode_k.shape[1]
    if context_v.shape[1] != Mc:
        raise ValueError(f"{ck_name} and {cv_name} must have one length, got Mc = {Mc} and {context_v.shape[1]}")
    if decode_v.shape[1] != Md:
        raise ValueError(f"decode_k and decode_v must have one decoded length, got Md = {Md} and {decode_v.shape[1]}")
    return n, Sq, Hq, D, Mc, Md, Hkv, Dv
