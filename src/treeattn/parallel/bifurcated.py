"""Bifurcated attention with the shared context sharded across ranks.

n samples decode from one long context whose K/V lives in the sequence-sharded cache: rank r
holds context positions of its shard only. Each step:

1. context part: every rank attends all n samples' queries, folded into one batch row
   (1, n * Sq, Hq, D), to its context shard, and ta.tree_decode combines the p partial states
   exactly (allreduce, binary tree or two-level). The context K/V is read once per step for all
   n samples, and only O(n * Sq * Hq * Dv) numbers travel, never K or V.
2. decode part: each sample's own decoded K/V is small (n * Md tokens next to Mc context
   tokens), so the caller keeps it whole on every rank: every rank passes the same decode_k and
   decode_v and computes the decode state itself, with no communication.
3. every rank merges the reduced context state with its decode state once, after the
   reduction, so each decoded key is counted exactly once and every rank ends with the same
   (out, lse).

The result equals ta.bifurcated_attention on the unsharded context (and so plain attention over
each sample's [context, decoded] K/V) up to rounding, for any number of ranks. This is the op on
its own tensors; the engine's shared-context decoding (ta.generate(num_samples=n), requests that
share a cached prefix) applies the same folding to the blocks its block tables share, with every
sample's own blocks sharded like the context (treeattn.engine.worker.shared_prefix).
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from treeattn.ops.bifurcated import check_bifurcated_inputs, decode_state, fold_samples, unfold_samples
from treeattn.ops.merge import merge_states
from treeattn.ops.validation import check_positions, check_scale
from treeattn.parallel import comm
from treeattn.parallel.metadata import UNKNOWN, Digest, device_code, dtype_code, float_code, tensor_digest, validate_and_agree
from treeattn.parallel.topology import Topology
from treeattn.parallel.tree_decode import METHODS, tree_decode

logger = logging.getLogger(__name__)

_MATCHED = ("n (q.shape[0])", "Sq (q.shape[1])", "Hq (q.shape[2])", "Hkv", "D (q.shape[3])", "Dv",
            "Md (decode_k.shape[1])", "dtype", "device", "scale", "positions given", "method", "ranks_per_node",
            "q_pos", "decode_pos", "q", "decode_k", "decode_v")


def sharded_bifurcated_attention(
    q: torch.Tensor,
    context_k_shard: torch.Tensor,
    context_v_shard: torch.Tensor,
    decode_k: torch.Tensor,
    decode_v: torch.Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    scale: float | None = None,
    q_pos: torch.Tensor | None = None,
    context_pos: torch.Tensor | None = None,
    decode_pos: torch.Tensor | None = None,
    method: str = "allreduce",
    topology: Topology | None = None,
    check_inputs: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Bifurcated attention over a context sharded along the sequence across the ranks of `group`.

    Call on every rank of the group. q, decode_k and decode_v are the same on every rank; the
    context tensors are this rank's shard (shards disjoint, any lengths, 0 too; their union is
    the whole context).

    Args:
        q: (n, Sq, Hq, D) float32, float16, bfloat16 or float64; n >= 1 samples.
        context_k_shard: (1, Mc_r, Hkv, D), this rank's keys of the shared context.
        context_v_shard: (1, Mc_r, Hkv, Dv).
        decode_k: (n, Md, Hkv, D), every sample's decoded keys, whole (not sharded).
        decode_v: (n, Md, Hkv, Dv).
        group: process group; None is the default world group.
        scale: softmax scale, default D ** -0.5.
        q_pos: int64 (Sq,) or (n, Sq). Without positions every query sees the whole context and,
            for Sq > 1, the queries are the last Sq decoded tokens (causal among themselves); this
            needs Sq <= Md + 1. With q_pos a key is visible iff its position <= the query's, and
            context_pos and decode_pos must be given too (a rank does not know where its shard
            starts).
        context_pos: int64 (Mc_r,) or (1, Mc_r), absolute positions of this rank's context keys.
        decode_pos: int64 (Md,) or (n, Md), absolute positions of the decoded keys.
        method: how tree_decode combines the context part: "allreduce", "tree" or "twolevel".
        topology: for "twolevel", Topology(ranks_per_node=k); see ta.tree_decode.
        check_inputs: validate this rank's inputs, then all-gather a few integers so that ranks
            that disagree (shapes, dtype, scale, method, positions, and checksums of q, decode_k,
            decode_v and their positions, which must be the same on every rank) raise the same
            ValueError on every rank instead of hanging or silently mixing. False: only the local
            attention calls validate the tensors.

    Returns:
        out: (n, Sq, Hq, Dv) in q.dtype; lse: (n, Hq, Sq) float32 (float64 for float64 inputs).
        Identical on every rank.

    Example (on every rank of a group: the shared context sharded, each sample's own tokens on every rank)::

        >>> import torch, torch.distributed as dist, treeattn as ta
        >>> rank, p = dist.get_rank(), dist.get_world_size()
        >>> g = torch.Generator().manual_seed(0)                       # the same tensors on every rank
        >>> q = torch.randn(4, 1, 8, 32, generator=g)                            # 4 samples
        >>> ck, cv = torch.randn(2, 1, 200, 2, 32, generator=g)                   # the shared context
        >>> dk, dv = torch.randn(2, 4, 5, 2, 32, generator=g)                     # each sample's own tokens
        >>> mine = slice(rank * 200 // p, (rank + 1) * 200 // p)
        >>> out, lse = ta.sharded_bifurcated_attention(q, ck[:, mine], cv[:, mine], dk, dv)
        >>> torch.allclose(out, ta.bifurcated_attention(q, ck, cv, dk, dv)[0], atol=1e-5)
        True
    """
    p = comm.group_size(group)
    resolved, _ = validate_and_agree(
        "sharded_bifurcated_attention", group,
        lambda: _check_local(q, context_k_shard, context_v_shard, decode_k, decode_v, scale, q_pos, context_pos, decode_pos,
                             method, topology, p, check_tensors=check_inputs),
        lambda resolved: _fields(q, decode_k, decode_v, resolved, method),
        gather=check_inputs and p > 1,
        must_match=_MATCHED,
        formatters={"method": lambda c: repr(METHODS[c]) if 0 <= c < len(METHODS) else "invalid"},
    )
    scale, q_pos, context_pos, decode_pos = resolved["scale"], resolved["q_pos"], resolved["context_pos"], resolved["decode_pos"]

    n, Sq = q.shape[0], q.shape[1]
    folded_q, folded_pos = fold_samples(q, q_pos)
    out_c, lse_c = tree_decode(
        folded_q,
        context_k_shard,
        context_v_shard,
        group=group,
        scale=scale,
        q_pos=None if folded_pos is None else folded_pos[0],
        kv_pos=None if context_pos is None else context_pos[0],
        method=method,
        topology=topology,
        check_inputs=False,  # agreement was checked above, with the decode inputs, in one all-gather
    )
    out_c, lse_c = unfold_samples(out_c, lse_c, n, Sq)
    if decode_k.shape[1] == 0:
        return out_c, lse_c
    out_d, lse_d = decode_state(q, decode_k, decode_v, scale=scale, q_pos=q_pos, decode_pos=decode_pos)
    return merge_states(out_c, lse_c, out_d, lse_d)


def _check_local(q, context_k_shard, context_v_shard, decode_k, decode_v, scale, q_pos, context_pos, decode_pos, method,
                 topology, p, *, check_tensors: bool = True):
    """This rank's validation. Returns the scale, positions as (1 or n, S) int64 (or None) and the
    topology's ranks per node (0 unless method is "twolevel"). check_tensors=False (check_inputs=False)
    reads the tensors' shapes without validating them: the local attention calls validate them."""
    tensors = (q, context_k_shard, context_v_shard, decode_k, decode_v)
    if check_tensors or not all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in tensors):
        n, Sq, Hq, D, Mc, Md, Hkv, Dv = check_bifurcated_inputs(
            *tensors, context_names=("context_k_shard", "context_v_shard")
        )
        scale = check_scale(scale, D)
    else:
        (n, Sq, Hq, D), (_, Mc, Hkv, _), Md, Dv = q.shape, context_k_shard.shape, decode_k.shape[1], decode_v.shape[3]
        scale = D ** -0.5 if scale is None else float(scale)
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if topology is not None and not isinstance(topology, Topology):
        raise TypeError(f"topology must be a treeattn Topology or None, got {type(topology).__name__}")
    ranks_per_node = (topology or Topology()).resolve(p) if method == "twolevel" else 0
    if q_pos is None:
        if context_pos is not None or decode_pos is not None:
            given = "context_pos" if context_pos is not None else "decode_pos"
            raise ValueError(f"{given} was given without q_pos; positions mask keys against the query positions, so pass q_pos "
                             f"too")
        if Sq > Md + 1:
            raise ValueError(
                f"without positions the Sq = {Sq} queries are the last decoded tokens, which needs Sq <= Md + 1 "
                f"(Md = {Md}); queries inside the sharded context need q_pos, context_pos and decode_pos"
            )
    else:
        missing = [name for name, pos in (("context_pos", context_pos), ("decode_pos", decode_pos)) if pos is None]
        if missing:
            raise ValueError(
                f"with q_pos the sharded variant also needs {' and '.join(missing)}: a rank does not know "
                "where its context shard starts, so positions cannot default"
            )
        q_pos = check_positions(q_pos, "q_pos", n, Sq, q.device)
        context_pos = check_positions(context_pos, "context_pos", 1, Mc, q.device)
        decode_pos = check_positions(decode_pos, "decode_pos", n, Md, q.device)
    return {"dims": (n, Sq, Hq, D, Md, Hkv, Dv), "scale": scale, "q_pos": q_pos, "context_pos": context_pos,
            "decode_pos": decode_pos, "ranks_per_node": ranks_per_node}


def _fields(q, decode_k, decode_v, resolved, method) -> dict[str, int | Digest]:
    """The metadata every rank contributes to the agreement check (UNKNOWN where rejected), with
    digests of what must be the same on every rank: q, the decoded K/V and their positions."""
    names = ("n (q.shape[0])", "Sq (q.shape[1])", "Hq (q.shape[2])", "D (q.shape[3])", "Md (decode_k.shape[1])", "Hkv", "Dv")
    same = ("q", "q_pos", "decode_k", "decode_v", "decode_pos")
    if resolved is None:
        fields = dict.fromkeys((*names, "dtype", "device", "scale", "positions given", "ranks_per_node"), UNKNOWN)
        fields.update(dict.fromkeys(same, Digest.unknown()))
    else:
        fields = dict(zip(names, resolved["dims"]))
        fields.update({
            "dtype": dtype_code(q.dtype),
            "device": device_code(q.device),
            "scale": float_code(resolved["scale"]),
            "positions given": int(resolved["q_pos"] is not None),
            "ranks_per_node": resolved["ranks_per_node"],
        })
        n, Sq = q.shape[0], q.shape[1]
        q_pos, decode_pos = resolved["q_pos"], resolved["decode_pos"]
        fields.update({
            "q": tensor_digest(q),
            "q_pos": tensor_digest(None if q_pos is None else q_pos.expand(n, Sq)),
            "decode_k": tensor_digest(decode_k),
            "decode_v": tensor_digest(decode_v),
            "decode_pos": tensor_digest(None if decode_pos is None else decode_pos.expand(n, decode_k.shape[1])),
        })
    fields["method"] = METHODS.index(method) if method in METHODS else UNKNOWN
    return fields
