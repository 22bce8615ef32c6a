"""Placement policies: which rank holds which token of a sequence-sharded KV cache.

The cache has `capacity` global slots (slot t holds the t-th token written, the same slot on every
layer). A placement maps each global slot to (rank, local slot). Both policies here fill every
rank's local slots in increasing order of global slot, so after `length` tokens a rank's used
slots are always the prefix [0, local_length(rank, length)) of its storage: attention can read
them as one view, and a new token never moves an old one.

- "contiguous": rank r holds the span [r * span, (r + 1) * span), span = ceil(capacity / p), as
  in the Tree Attention paper. Decode appends all land on the rank whose span is filling.
- "interleaved": blocks of `block_size` slots are dealt round-robin (block b on rank b % p), so
  appends stay balanced across ranks, and causal prefill work is balanced too (striping).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

PLACEMENTS = ("contiguous", "interleaved")


class Placement(ABC):
    """Map global cache slots to (rank, local slot) for a cache of `capacity` slots on `world_size` ranks."""

    kind: str = ""

    def __init__(self, capacity: int, world_size: int, block_size: int) -> None:
        for name, value, low in (("capacity", capacity, 1), ("world_size", world_size, 1), ("block_size", block_size, 1)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be an int, got {type(value).__name__}")
            if value < low:
                raise ValueError(f"{name} must be >= {low}, got {value}")
        self.capacity = capacity
        self.world_size = world_size
        self.block_size = block_size

    @abstractmethod
    def owner(self, slots: torch.Tensor) -> torch.Tensor:
        """int64 (n,) global slots -> int64 (n,) rank holding each slot."""

    @abstractmethod
    def local_slot(self, slots: torch.Tensor) -> torch.Tensor:
        """int64 (n,) global slots -> int64 (n,) index of each slot in its owner's storage."""

    @abstractmethod
    def local_length(self, rank: int, length: int) -> int:
        """How many of the global slots [0, length) rank `rank` holds."""

    def local_capacity(self, rank: int) -> int:
        """How many slots rank `rank` holds when the cache is full."""
        return self.local_length(rank, self.capacity)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(capacity={self.capacity}, world_size={self.world_size}, block_size={self.block_size})"


class ContiguousPlacement(Placement):
    """Rank r holds the global slots [r * span, min((r + 1) * span, capacity)), span = ceil(capacity / p)."""

    kind = "contiguous"

    def __init__(self, capacity: int, world_size: int, block_size: int) -> None:
        super().__init__(capacity, world_size, block_size)
        self.span = -(-capacity // world_size)

    def owner(self, slots: torch.Tensor) -> torch.Tensor:
        return torch.div(slots, self.span, rounding_mode="floor")

    def local_slot(self, slots: torch.Tensor) -> torch.Tensor:
        return slots - self.owner(slots) * self.span

    def local_length(self, rank: int, length: int) -> int:
        start = rank * self.span
        end = min(start + self.span, self.capacity)
        return max(0, min(length, end) - start)


class InterleavedPlacement(Placement):
    """Block b = slot // block_size lives on rank b % p, as that rank's local block b // p."""

    kind = "interleaved"

    def owner(self, slots: torch.Tensor) -> torch.Tensor:
        return torch.div(slots, self.block_size, rounding_mode="floor") % self.world_size

    def local_slot(self, slots: torch.Tensor) -> torch.Tensor:
        block = torch.div(slots, self.block_size, rounding_mode="floor")
        return torch.div(block, self.world_size, rounding_mode="floor") * self.block_size + slots % self.block_size

    def local_length(self, rank: int, length: int) -> int:
        length = min(length, self.capacity)
        full_blocks, partial = divmod(length, self.block_size)
        p = self.world_size
        mine = max(0, (full_blocks - rank + p - 1) // p) * self.block_size
        if full_blocks % p == rank:
            mine += partial
        return mine


def make_placement(kind: str, capacity: int, world_size: int, block_size: int) -> Placement:
    """Build the placement policy named `kind` ("contiguous" or "interleaved")."""
    if kind == "contiguous":
        return ContiguousPlacement(capacity, world_size, block_size)
    if kind == "interleaved":
        return InterleavedPlacement(capacity, world_size, block_size)
    raise ValueError(f"placement must be one of {PLACEMENTS}, got {kind!r}")
