"""Shared-context sampling in the model's forward pass: n samples decode from one prompt.

The prompt (the shared context) is prefilled once, for one sequence, into the sequence-sharded
ShardedKVCache. The n samples' own tokens go to a second, unsharded cache with batch n that every
rank keeps whole (ShardedKVCache with world_size 1): decoded tokens are few next to the context.
Each decode step the model runs the n new tokens through its layers with this module's matched
pair of kv_store and attend:

- SharedContextUpdate (the kv_store): writes the n new keys/values into the samples' cache and
  hands each layer both parts, as SplitKV pairs: (context of this rank (1, Mc_r, Hkv, D),
  decoded (n, Md, Hkv, D)), and the same for values and positions.
- BifurcatedAttention (the attend): ta.bifurcated_attention on one process, or
  ta.sharded_bifurcated_attention across the ranks of a group (the context part through
  tree_decode). The context K/V is read once per step for all n samples.

The model passes whatever kv_store returns to attend unchanged, so the two must be used together.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist

from treeattn.cache.sharded import CacheUpdate, ShardedKVCache
from treeattn.models.attention import hide_outside_window
from treeattn.ops.bifurcated import bifurcated_attention


class SplitKV(NamedTuple):
    """One layer's keys (or values, or positions) in two parts.

    context: (1, Mc_r, Hkv, D) this rank's shard of the prompt (positions: int64 (1, Mc_r)).
    decoded: (n, Md, Hkv, D) every sample's decoded tokens, whole (positions: int64 (n, Md)).
    """

    context: torch.Tensor
    decoded: torch.Tensor


class SharedContextUpdate:
    """kv_store for one decode step of n samples over a shared context.

    Args:
        context: the prompt's ShardedKVCache (batch 1), already prefilled; not written to.
        decoded: the CacheUpdate of the samples' cache (batch n) for this step's new tokens.
    """

    def __init__(self, context: ShardedKVCache, decoded: CacheUpdate) -> None:
        if context.batch_size != 1:
            raise ValueError(f"the shared context cache must hold one sequence, got batch_size={context.batch_size}")
        self.context = context
        self.decoded = decoded

    def __call__(self, layer: int, k_new: torch.Tensor, v_new: torch.Tensor) -> tuple[SplitKV, SplitKV, SplitKV]:
        """Store the n new tokens' keys/values of `layer` (k_new, v_new: (n, 1, Hkv, D)) and return
        SplitKV keys, values and positions to attend to."""
        decoded_k, decoded_v, decoded_pos = self.decoded(layer, k_new, v_new)
        context_k, context_v = self.context.layer(layer)
        return SplitKV(context_k, decoded_k), SplitKV(context_v, decoded_v), SplitKV(self.context.kv_pos, decoded_pos)


class BifurcatedAttention:
    """attend for SharedContextUpdate: bifurcated attention, sharded across `group` when given.

    Args:
        group: process group whose ranks hold the context's shards; None on one process.
        method, topology: how tree_decode combines the context part across ranks.
    """

    name = "bifurcated"

    def __init__(self, group: dist.ProcessGroup | None = None, *, sharded: bool = False, method: str = "allreduce", topology=None) -> None:
        self.group = group
        self.sharded = sharded
        self.method = method
        self.topology = topology

    def __call__(self, q: torch.Tensor, k: SplitKV, v: SplitKV, *, q_pos: torch.Tensor, kv_pos: SplitKV, window: int | None) -> torch.Tensor:
        """q: (n, 1, Hq, D), one new token per sample, all at the same position (samples decode in
        lockstep); q_pos int64 (n, 1). Returns out (n, 1, Hq, D) in q.dtype."""
        if q.shape[1] != 1:
            raise ValueError(f"shared-context sampling decodes one token per sample per step, got q of shape {tuple(q.shape)}")
        positions = {}
        if window is not None and int(q_pos.max()) >= window:
            # The window hides the oldest keys: move them past the query (positions only, never K/V).
            positions = dict(
                q_pos=q_pos,
                context_pos=hide_outside_window(q_pos[:1], kv_pos.context, window),
                decode_pos=hide_outside_window(q_pos, kv_pos.decoded, window),
            )
        # Without a biting window every sample's query sees the whole context and all its own
        # decoded tokens (the new one included): no positions, no masks.
        if self.sharded:
            from treeattn.parallel.bifurcated import sharded_bifurcated_attention

            out, _ = sharded_bifurcated_attention(
                q, k.context, v.context, k.decoded, v.decoded, group=self.group, method=self.method,
                topology=self.topology, check_inputs=False, **positions,
            )  # the engine checked once, at setup, that the ranks agree
        else:
            out, _ = bifurcated_attention(q, k.context, v.context, k.decoded, v.decoded, **positions)
        return out
