"""The sequence-sharded KV cache: placement policies and per-rank block storage.

- The engine's cache (ta.Engine, and ta.generate, which runs on it): refcounted block pools and the
  placement of logical blocks on the ranks (blocks.py, placement.py), each rank's paged arena of
  block tensors (paged.py), the radix prefix cache over blocks (prefix.py), and a hybrid model's
  sliding-window layers, kept whole on every rank (window.py); the prefix cache's second tier, a
  directory of checksummed block files keyed by the token-prefix hash chain (store.py).
- ShardedKVCache (sharded.py): one batch's cache, one preallocated arena per rank, for callers that
  run a model layer by layer themselves: the transformers plug-in (treeattn.hf.ShardedCache) and
  the tests' references. Its static API (StaticCacheUpdate, static_layer) is the graph-safe
  building block tested beside ops.graph_safe; the engine's static step reads the paged arena.
"""

from treeattn.cache.blocks import BlockPool, BlockRef, ShardedBlockPool
from treeattn.cache.paged import PagedKVCache
from treeattn.cache.placement import PLACEMENTS, ContiguousPlacement, InterleavedPlacement, Placement, make_placement
from treeattn.cache.prefix import PrefixCache
from treeattn.cache.store import KVStore
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
    "KVStore",
    "PagedKVCache",
    "Placement",
    "PrefixCache",
    "ShardedBlockPool",
    "ShardedKVCache",
    "SlotRange",
    "StaticCacheUpdate",
    "make_placement",
]
