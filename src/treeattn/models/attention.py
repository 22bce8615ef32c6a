"""The attention algorithms a model layer can call: one signature, four implementations.

    attend(q, k, v, *, q_pos, kv_pos, window) -> out

    q:      (B, S, Hq, D) this pass's queries (RoPE applied).
    k, v:   (B, Sk, Hkv, D) the keys/values this rank holds (its shard of the cache).
    q_pos:  int64 (B, S) absolute positions of the queries (-1: padding, sees nothing).
    kv_pos: int64 (B, Sk) absolute positions of the keys.
    window: sliding window W of this layer or None: a key is visible iff kv_pos <= q_pos and
            q_pos - kv_pos < W.
    out:    (B, S, Hq, D) in q.dtype, exact causal attention over the keys of ALL ranks.

- LocalAttention: one device (treeattn.ops.attention); the cache is not sharded.
- TreeAttention: tree_decode: every rank attends q to its shard, the states merge across ranks.
  q must be the same on every rank (decoding; also chunked prefill where every rank runs the chunk).
- RingDecodeAttention: ring_decode, the baseline: K/V shards travel the ring (pass_kv=True).
- GraphSafeDecodeAttention: the attention of a static-shape decode step (treeattn.engine.worker.static_step):
  local, tree or ring with no host synchronization, over fixed-shape keys (a rank's blocks of each
  sequence gathered into (B, NB * block_size, Hkv, D), unused slots at INVISIBLE_POSITION).

The engine builds its back end once per rank with attention_backend (treeattn.engine.worker.runner); its
dynamic steps call it per group of sequences (treeattn.engine.worker.batch), except where the paged decode
kernel (treeattn.ops.paged_decode) reads the blocks in place and combines across the ranks itself.

Sliding windows: tree_decode and ring_decode mask by causality only. For one query per sequence
(Sq = 1) a window is the same as hiding the keys with q_pos - kv_pos >= W, which is done by
moving their positions past the query (only positions change, never K/V). Several queries with a
window that bites go one query at a time. (The engine's ring prefill steps are
treeattn.engine.worker.ring_prefill: ring attention over the cached prefix.)
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from treeattn.cache.sharded import INVISIBLE_POSITION
from treeattn.ops import attention, merge_states
from treeattn.parallel import comm

DECODE_KINDS = ("local", "tree", "ring")


class LocalAttention:
    """Single-device causal attention over all keys (ops.attention).

    For a chunk of several queries (chunked prefill), the leading keys that every query sees -- the
    tokens before the chunk -- are attended without a mask, which the CPU kernel does several times
    faster than a masked block; only the rest goes through the causal mask. The two states merge
    exactly (merge_states).
    """

    name = "local"

    def __call__(self, q, k, v, *, q_pos, kv_pos, window):
        split = visible_prefix(q_pos, kv_pos, window) if q.shape[1] > 1 else 0
        if split == 0:
            return attention(q, k, v, causal=True, q_pos=q_pos, kv_pos=kv_pos, window=window)[0]
        head = attention(q, k[:, :split], v[:, :split])
        tail = attention(q, k[:, split:], v[:, split:], causal=True, q_pos=q_pos, kv_pos=kv_pos[:, split:], window=window)
        return merge_states(*head, *tail)[0]


class _ShardedDecodeAttention:
    """Common part of the sharded decode attentions: q is the same on every rank of `group`."""

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self.group = group

    def _combine(self, q, k, v, q_pos, kv_pos):  # one call of the distributed algorithm
        raise NotImplementedError

    def __call__(self, q, k, v, *, q_pos, kv_pos, window):
        if window is None:
            return self._combine(q, k, v, q_pos, kv_pos)
        if q.shape[1] == 1:  # one query (a decode step): hide what its window excludes, no host read
            return self._combine(q, k, v, q_pos, hide_outside_window(q_pos, kv_pos, window))
        if int(q_pos.max()) < window:  # q_pos is the same on every rank
            return self._combine(q, k, v, q_pos, kv_pos)
        outs = []
        for i in range(q.shape[1]):  # the window differs per query: one query at a time
            qp = q_pos[:, i : i + 1]
            outs.append(self._combine(q[:, i : i + 1], k, v, qp, hide_outside_window(qp, kv_pos, window)))
        return torch.cat(outs, dim=1)


class TreeAttention(_ShardedDecodeAttention):
    """tree_decode over the ranks of `group` with the given method ("allreduce", "tree", "twolevel")."""

    name = "tree"

    def __init__(self, method: str = "allreduce", group: dist.ProcessGroup | None = None, topology=None) -> None:
        super().__init__(group)
        self.method = method
        self.topology = topology

    def _combine(self, q, k, v, q_pos, kv_pos):
        from treeattn.parallel import tree_decode

        # The engine checks once that the ranks agree (generate's setup check); skip the per-call gather.
        out, _ = tree_decode(q, k, v, group=self.group, q_pos=q_pos, kv_pos=kv_pos, method=self.method,
                             topology=self.topology, check_inputs=False)
        return out


class RingDecodeAttention(_ShardedDecodeAttention):
    """ring_decode over the ranks of `group` (pass_kv=True: the K/V shards travel the ring)."""

    name = "ring"

    def __init__(self, group: dist.ProcessGroup | None = None, pass_kv: bool = True) -> None:
        super().__init__(group)
        self.pass_kv = pass_kv

    def _combine(self, q, k, v, q_pos, kv_pos):
        from treeattn.parallel import ring_decode

        out, _ = ring_decode(q, k, v, group=self.group, q_pos=q_pos, kv_pos=kv_pos, pass_kv=self.pass_kv, check_inputs=False)
        return out


class GraphSafeDecodeAttention:
    """Decode attention with no host synchronization, for a static-shape step (treeattn.engine.worker.static_step).

    k, v are this rank's keys of each sequence in fixed shapes (the static step gathers its blocks
    into (B, NB * block_size, Hkv, D); ShardedKVCache.static_layer gives a whole preallocated shard)
    and kv_pos marks the unused slots INVISIBLE_POSITION. One query per sequence: a sliding window is applied by
    hiding keys through their positions, on the device.

    Args:
        kind: "local" (graph_safe_attention, one process), "tree" (tree_decode) or "ring"
            (ring_decode, pass-KV).
        method, group, topology: as for TreeAttention.
        kv_len: int64 (B,) on the cache's device: this rank's slots in use, read at every call
            (the step updates it in place); "local" and "tree" skip the slots past it.
        shard_lengths: for "ring": every rank's static shard length (local_capacity), in group
            rank order, so that no lengths are gathered.
    """

    name = "graph-safe"

    def __init__(self, kind: str, *, method: str = "allreduce", group: dist.ProcessGroup | None = None, topology=None,
                 kv_len: torch.Tensor | None = None, shard_lengths: list[int] | None = None) -> None:
        if kind not in DECODE_KINDS:
            raise ValueError(f"kind must be one of {DECODE_KINDS}, got {kind!r}")
        self.kind, self.method, self.group, self.topology = kind, method, group, topology
        self.kv_len = kv_len
        self.shard_lengths = shard_lengths

    def __call__(self, q, k, v, *, q_pos, kv_pos, window):
        if q.shape[1] != 1:
            raise ValueError(f"graph-safe decode attention takes one query per sequence, got q of shape {tuple(q.shape)}")
        if window is not None:
            kv_pos = hide_outside_window(q_pos, kv_pos, window)
        if self.kind == "local":
            from treeattn.ops.graph_safe import graph_safe_attention

            return graph_safe_attention(q, k, v, q_pos=q_pos, kv_pos=kv_pos, kv_len=self.kv_len)[0]
        if self.kind == "tree":
            from treeattn.parallel import tree_decode

            return tree_decode(q, k, v, group=self.group, q_pos=q_pos, kv_pos=kv_pos, method=self.method, topology=self.topology,
                               check_inputs=False, graph_safe=True, kv_len=self.kv_len)[0]
        from treeattn.parallel import ring_decode

        return ring_decode(q, k, v, group=self.group, q_pos=q_pos, kv_pos=kv_pos, pass_kv=True, check_inputs=False,
                           shard_lengths=self.shard_lengths, graph_safe=True)[0]


def visible_prefix(q_pos: torch.Tensor, kv_pos: torch.Tensor, window: int | None) -> int:
    """How many leading keys are visible to every query: q_pos (B, Sq), kv_pos (B, Sk) int64."""
    first_query_pos = q_pos.min(dim=1, keepdim=True).values
    seen_by_all = kv_pos <= first_query_pos
    if window is not None:
        seen_by_all &= q_pos.max(dim=1, keepdim=True).values - kv_pos < window
    return int(seen_by_all.all(dim=0).int().cumprod(dim=0).sum())


def hide_outside_window(q_pos: torch.Tensor, kv_pos: torch.Tensor, window: int) -> torch.Tensor:
    """kv_pos (B, Sk) with the keys outside the window of the single query q_pos (B, 1) moved to
    INVISIBLE_POSITION, so that causal masking alone applies the window."""
    return torch.where(q_pos - kv_pos >= window, torch.full_like(kv_pos, INVISIBLE_POSITION), kv_pos)


def group_world_size(group: dist.ProcessGroup | None) -> int:
    """Ranks in `group` (None: the world); 1 when torch.distributed is not initialized."""
    if not (dist.is_available() and dist.is_initialized()):
        if group is not None:
            raise ValueError("group was given but torch.distributed is not initialized")
        return 1
    return comm.group_size(group)


def attention_backend(decode: str, *, method: str = "allreduce", group: dist.ProcessGroup | None = None, topology=None,
                      graph_safe: bool = False, kv_len: torch.Tensor | None = None, shard_lengths: list[int] | None = None):
    """The one place a rank's decode attention is built (the engine's runner and its static decode step come here).

    Args:
        decode: "tree" (tree_decode), "ring" (ring_decode, pass-KV) or "local". On a group of one
            rank (or without torch.distributed) every kind is plain local attention: there is
            nothing to combine. "local" on several ranks is refused.
        method, topology: tree_decode's combine.
        group: the ranks whose shards are combined (None: the world).
        graph_safe: the static-shape step's attention (GraphSafeDecodeAttention) with `kv_len`
            and, for "ring", `shard_lengths`.

    Returns:
        attend(q, k, v, *, q_pos, kv_pos, window) -> out, as the model calls it.
    """
    if decode not in DECODE_KINDS:
        raise ValueError(f"decode must be one of {DECODE_KINDS}, got {decode!r}")
    p = group_world_size(group)
    if decode == "local" and p > 1:
        raise ValueError(f"decode='local' runs on one rank, but the group has {p}; use 'tree' or 'ring'")
    kind = decode if p > 1 else "local"
    if graph_safe:
        return GraphSafeDecodeAttention(kind, method=method, group=group, topology=topology, kv_len=kv_len,
                                        shard_lengths=shard_lengths)
    return decode_attention(kind, method=method, group=group, topology=topology)


def decode_attention(kind: str, *, method: str = "allreduce", group: dist.ProcessGroup | None = None, topology=None):
    """The decode attention named `kind` ("local", "tree" or "ring"), whatever the group's size
    (attention_backend is what engine code calls: it also picks "local" for one rank)."""
    if kind == "local":
        return LocalAttention()
    if kind == "tree":
        return TreeAttention(method, group, topology)
    if kind == "ring":
        return RingDecodeAttention(group)
    raise ValueError(f"decode must be one of {DECODE_KINDS}, got {kind!r}")
