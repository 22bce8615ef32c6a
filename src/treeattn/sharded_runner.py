"""A model run over its own sequence-sharded KV cache, on every rank of a group.

    runner = ShardedRunner(model, cache, decode="tree", method="onepass", prefill="ring", group=group)
    last = runner.prefill(tokens, positions)     # the prompt into the cache: (B, hidden_size) of its last slot
    hidden = runner.forward(tokens, positions)   # S more tokens per sequence: (B, S, hidden_size)

Every rank of the group makes the same calls with the same tokens; each keeps only the keys and
values its cache's placement gives it, and gets the same hidden states (the queries are the same
on every rank; attention combines the shards). treeattn.generate runs its model through one, and
the draft model of speculative decoding through another, its cache sharded like the model's
(treeattn.draft_model).

- prefill "ring": rank r runs only the prompt tokens its shard holds, through all layers; each
  layer's attention is ring_attention, so the prompt's compute is split p ways. The last slot's
  hidden state is broadcast from the rank that holds it.
- prefill "local": every rank runs the whole prompt, `chunk` tokens at a time, each chunk
  attending to the cache through the decode attention.
- prefill "reused": the cache already holds the prompt; its last token is run again (forward).
- forward: the decode attention, "tree" (tree_decode with `method`), "ring" (ring_decode, pass-KV)
  or "local" (one rank); S >= 1 causal queries at their positions (a decode step, or a token and
  its drafts under speculative decoding: one combine per layer for all of them).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from treeattn.cache import ShardedKVCache
from treeattn.models.attention import RingPrefillAttention, decode_attention

PREFILL_KINDS = ("ring", "local", "reused")


class ShardedRunner:
    """Forward passes of `model` over `cache` on this rank (call on every rank of the group together).

    Args:
        model: the model (a LlamaModel), the same weights on every rank.
        cache: this rank's ShardedKVCache for `model`: its rank and world_size are the group's, or
            world_size 1 for a cache this process holds whole (then nothing is combined or broadcast).
        decode: "tree", "ring" or "local" (one rank): the attention of forward().
        method: tree_decode's method ("allreduce", "tree", "twolevel", "onepass").
        prefill: "ring", "local" or "reused" (see the module docstring).
        group: what the combines and broadcasts go through: the process group, or its shared-memory
            group (treeattn.parallel.shared_memory_group); None: the default group (or one process).
        topology: treeattn Topology for method "twolevel".
        chunk: tokens per chunk of the "local" prefill and of MLP activations.
    """

    def __init__(self, model, cache: ShardedKVCache, *, decode: str, method: str, prefill: str,
                 group: dist.ProcessGroup | None = None, topology=None, chunk: int = 1024) -> None:
        if prefill not in PREFILL_KINDS:
            raise ValueError(f"prefill must be one of {PREFILL_KINDS}, got {prefill!r}")
        self.model, self.cache, self.prefill_kind, self.chunk = model, cache, prefill, chunk
        self.decode, self.method, self.group, self.topology = decode, method, group, topology
        # A cache of one rank (one process, or a draft model's whole cache on rank 0) has nothing to combine.
        self.attend = decode_attention(decode if cache.world_size > 1 else "local", method=method, group=group, topology=topology)

    def prefill(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Run the prompt into the (empty, or for "reused" prompt-holding) cache.

        Args:
            tokens: int64 (B, L) on the model's device, left-padded.
            positions: int64 (B, L), PAD_POSITION on padding.

        Returns:
            (B, hidden_size) final hidden state of the last prompt slot, the same on every rank.
        """
        length = tokens.shape[1]
        if self.prefill_kind == "reused":
            self.cache.truncate(length - 1)
            return self.forward(tokens[:, -1:], positions[:, -1:])[:, -1]
        if self.prefill_kind == "ring" and self.cache.world_size > 1:
            slots = self.cache.extend(positions)
            mine = slots.owned.to(tokens.device)
            attend = RingPrefillAttention(self.group, sequence_length=length)
            hidden = self.model(tokens[:, mine], positions[:, mine], self.cache.update(slots), attend, chunk=self.chunk)
            last_owner = int(self.cache.placement.owner(torch.tensor([length - 1])))
            if self.cache.rank == last_owner:
                last = hidden[:, -1].contiguous()
            else:
                last = torch.empty(hidden.shape[0], hidden.shape[2], dtype=hidden.dtype, device=hidden.device)
            return self.broadcast(last, src=last_owner)
        for start in range(0, length, self.chunk):
            hidden = self.forward(tokens[:, start: start + self.chunk], positions[:, start: start + self.chunk])
        return hidden[:, -1]

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Run S new tokens of every sequence after the cached ones; their keys/values land on the
        ranks the placement names.

        Args:
            tokens: int64 (B, S) on the model's device.
            positions: int64 (B, S), causal positions (PAD_POSITION on padding).

        Returns:
            (B, S, hidden_size) final hidden states, in the model's dtype.
        """
        slots = self.cache.extend(positions)
        return self.model(tokens, positions, self.cache.update(slots, slots.owned), self.attend, chunk=self.chunk)

    def broadcast(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        """In-place broadcast of a contiguous tensor from group rank `src` over `group`; returns it."""
        if self.cache.world_size == 1:
            return tensor
        from treeattn.parallel import comm

        return comm.broadcast(tensor, src, self.group)
