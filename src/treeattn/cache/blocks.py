"""Reference-counted cache blocks of a sequence-sharded KV cache (host-side bookkeeping).

The engine's cache is a pool of fixed-size blocks on every rank (treeattn.cache.paged holds the
tensors). A sequence's tokens fill logical blocks 0, 1, 2, ... (block j holds positions
[j * block_size, (j + 1) * block_size)); the placement names the rank that holds logical block j,
and that rank's pool lends one of its physical blocks for it:

    "contiguous":  block j on rank j // span_blocks  (rank r holds one span of the sequence)
    "interleaved": block j on rank j % p              (blocks dealt round-robin)

"contiguous" is the Tree Attention paper's layout. A span is span_blocks blocks: by default
blocks_per_rank (the spans are cut over the whole cache), or the p-th part of the longest sequence
the engine admits (its max_context), so that such a sequence is split evenly over the p ranks. A
sequence shorter than one span lives on rank 0 alone, so short requests fill rank 0 first (the
other ranks' blocks serve only longer sequences). "interleaved" spreads every sequence, short or
long, over all ranks: the better choice for serving many requests.

Because the owner depends only on j, two sequences that share a prefix need the same ranks for it,
so a cached block can be shared by any sequence that starts with the same tokens (the prefix
cache, treeattn.cache.prefix). A block is shared by counting references: every sequence using it
holds one, the prefix cache holds one while the block is cached, and the block is free again when
the count drops to zero.

Everything here is plain Python run by the engine's driver; the ranks only see the block tables
it sends them.
"""

from __future__ import annotations

from collections import deque
from typing import NamedTuple

from treeattn.cache.placement import PLACEMENTS


class BlockRef(NamedTuple):
    """One physical block: `index` in the pool of rank `rank`."""

    rank: int
    index: int


class BlockPool:
    """The physical blocks of one rank: ids 0..num_blocks-1, each free or with a reference count.

    Args:
        num_blocks: blocks in this rank's pool (>= 0).
    """

    def __init__(self, num_blocks: int) -> None:
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 0:
            raise ValueError(f"num_blocks must be an int >= 0, got {num_blocks!r}")
        self.num_blocks = num_blocks
        self.refcount = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def allocate(self) -> int:
        """Take a free block (reference count 1). Raises RuntimeError when none is free."""
        if not self._free:
            raise RuntimeError(f"no free block in a pool of {self.num_blocks}")
        block = self._free.popleft()
        self.refcount[block] = 1
        return block

    def incref(self, block: int) -> None:
        """One more user of a block in use."""
        if self.refcount[block] < 1:
            raise RuntimeError(f"block {block} is free; only a block in use can gain a reference")
        self.refcount[block] += 1

    def decref(self, block: int) -> bool:
        """One user fewer; returns True if that freed the block."""
        if self.refcount[block] < 1:
            raise RuntimeError(f"block {block} is already free (double free)")
        self.refcount[block] -= 1
        if self.refcount[block] == 0:
            self._free.append(block)
            return True
        return False


class ShardedBlockPool:
    """The block pools of all p ranks of a sharded cache, and the placement of logical blocks.

    Args:
        world_size: p, the number of ranks.
        blocks_per_rank: physical blocks in every rank's pool.
        block_size: tokens per block.
        placement: "contiguous" or "interleaved" (see the module docstring).
        span_blocks: with "contiguous", the blocks of one sequence on each rank (logical block j
            on rank j // span_blocks), in [1, blocks_per_rank]; None: blocks_per_rank.
    """

    def __init__(self, *, world_size: int, blocks_per_rank: int, block_size: int, placement: str,
                 span_blocks: int | None = None) -> None:
        span_blocks = blocks_per_rank if span_blocks is None else span_blocks
        for name, value in (("world_size", world_size), ("blocks_per_rank", blocks_per_rank), ("block_size", block_size),
                            ("span_blocks", span_blocks)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if placement not in PLACEMENTS:
            raise ValueError(f"placement must be one of {PLACEMENTS}, got {placement!r}")
        self.world_size = world_size
        self.blocks_per_rank = blocks_per_rank
        self.block_size = block_size
        if span_blocks > blocks_per_rank:
            raise ValueError(f"span_blocks must be at most blocks_per_rank={blocks_per_rank}, got {span_blocks}")
        self.placement = placement
        self.span_blocks = span_blocks
        self.pools = [BlockPool(blocks_per_rank) for _ in range(world_size)]

    @property
    def max_tokens_per_sequence(self) -> int:
        """The longest sequence the cache can hold (every block of every rank; with "contiguous",
        p spans)."""
        blocks = self.blocks_per_rank if self.placement == "interleaved" else self.span_blocks
        return self.world_size * blocks * self.block_size

    @property
    def num_blocks(self) -> int:
        return self.world_size * self.blocks_per_rank

    @property
    def num_free(self) -> int:
        return sum(pool.num_free for pool in self.pools)

    def owner(self, logical_block: int) -> int:
        """The rank that holds logical block `logical_block` of any sequence."""
        if self.placement == "interleaved":
            return logical_block % self.world_size
        return logical_block // self.span_blocks

    def blocks_needed(self, have: int, want: int) -> list[int]:
        """Per rank, the physical blocks that growing a sequence from `have` to `want` logical
        blocks takes."""
        needed = [0] * self.world_size
        for j in range(have, want):
            needed[self.owner(j)] += 1
        return needed

    def can_allocate(self, needed: list[int]) -> bool:
        return all(n <= pool.num_free for n, pool in zip(needed, self.pools))

    def allocate(self, logical_block: int) -> BlockRef:
        """A new block (reference count 1) for logical block `logical_block`, on its owner."""
        rank = self.owner(logical_block)
        return BlockRef(rank, self.pools[rank].allocate())

    def incref(self, block: BlockRef) -> None:
        self.pools[block.rank].incref(block.index)

    def decref(self, block: BlockRef) -> bool:
        return self.pools[block.rank].decref(block.index)

    def refcount(self, block: BlockRef) -> int:
        return self.pools[block.rank].refcount[block.index]

    def __repr__(self) -> str:
        return (f"ShardedBlockPool(p={self.world_size}, {self.blocks_per_rank} blocks/rank x {self.block_size} tokens, "
                f"{self.placement}, free={self.num_free}/{self.num_blocks})")


def tokens_to_blocks(num_tokens: int, block_size: int) -> int:
    """Blocks needed to hold `num_tokens` tokens (ceil)."""
    return -(-num_tokens // block_size)
