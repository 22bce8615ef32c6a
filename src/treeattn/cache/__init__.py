"""The sequence-sharded KV cache: placement policies and per-rank block storage.

- ShardedKVCache (sharded.py): one batch's cache, one arena per rank (ta.generate).
- The engine's cache: refcounted block pools and the placement of logical blocks (blocks.py),
  each rank's block tensors (paged.py), the radix prefix cache over blocks (prefix.py).
"""

from treeattn.cache.blocks import BlockPool, BlockRef, ShardedBlockPool
from treeattn.cache.paged import PagedKVCache
from treeattn.cache.placement import PLACEMENTS, ContiguousPlacement, InterleavedPlacement, Placement, make_placement
from treeattn.cache.prefix import PrefixCache
from treeattn.cache.sharded import INVISIBLE_POSITION, PAD_POSITION, CacheUpdate, ShardedKVCache, SlotRange, StaticCacheUpdate

__all__ = [
    "PLACEMENTS",
    "INVISIBLE_POSITION",
    "PAD_POSITION",
    "BlockPool",
    "BlockRef",
    "CacheUpdate",
    "ContiguousPlacement",
    "InterleavedPlacement",
    "PagedKVCache",
    "Placement",
    "PrefixCache",
    "ShardedBlockPool",
    "ShardedKVCache",
    "SlotRange",
    "StaticCacheUpdate",
    "make_placement",
]
