"""The sequence-sharded KV cache: placement policies and per-rank block storage."""

from treeattn.cache.placement import PLACEMENTS, ContiguousPlacement, InterleavedPlacement, Placement, make_placement
from treeattn.cache.sharded import INVISIBLE_POSITION, PAD_POSITION, CacheUpdate, ShardedKVCache, SlotRange, StaticCacheUpdate

__all__ = [
    "PLACEMENTS",
    "INVISIBLE_POSITION",
    "PAD_POSITION",
    "CacheUpdate",
    "ContiguousPlacement",
    "InterleavedPlacement",
    "Placement",
    "ShardedKVCache",
    "SlotRange",
    "StaticCacheUpdate",
    "make_placement",
]
