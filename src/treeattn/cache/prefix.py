"""The prefix cache: a radix tree over token ids at block granularity (RadixAttention, SGLang).

Every edge of the tree is one full block of `block_size` token ids, and the node it leads to owns
the cache block holding those tokens' keys and values (its BlockRef; on the rank the placement
names for that logical block, since a node at depth j is logical block j of every sequence that
reaches it). A path from the root spells a token prefix; its nodes' blocks are that prefix's KV.

    tree = PrefixCache(pool)
    blocks = tree.match(prompt)            # blocks of the longest cached full-block prefix
    ...                                    # the caller takes a reference on each block it uses
    tree.insert(tokens, seq_blocks)        # cache a finished sequence's full blocks
    tree.evict(rank, n)                    # free unreferenced blocks, least recently used first

The tree holds one reference on every block it owns; a block is in use by sequences while its
count is above 1. Only leaves whose block nobody else references can be evicted, so a cached
prefix never loses a block from its middle. Partial blocks are never cached (a sequence's last,
partly filled block stays private to it), as in SGLang with page_size > 1 and vLLM's block hashes.

A hybrid model (window and global layers, Gemma 3) needs more than blocks to start a sequence at a
cached boundary b: its window layers' rows of positions [b - W + 1, b), which the paged blocks do
not hold (treeattn.cache.window). With `checkpoints=N` the tree keeps at most N window checkpoints,
each attached to the node of its boundary: `add_checkpoint` gives a node a new id (the ranks save
the window state under it), `match` stops at the deepest node of the matched path that has one
(its id comes with `match_checkpointed`), and a checkpoint whose node is evicted, or the least
recently used one when a new one exceeds N, is listed by `take_dropped` (the ranks free it).

Every node also carries its block's key in the token-prefix hash chain (treeattn.cache.store:
`digest`, the blake2b of its parent's and its own tokens): the name of the block in a KV store.
With `record_new=True` the tree lists the (key, block) of every node it creates, for `take_new`
(the engine writes those blocks through to its store, treeattn.engine.kv_tier).
"""

from __future__ import annotations

import heapq
import itertools

from treeattn.cache.blocks import BlockRef, ShardedBlockPool
from treeattn.cache.store import ROOT, block_digest


class _Node:
    __slots__ = ("parent", "key", "block", "children", "last_access", "checkpoint", "digest")

    def __init__(self, parent: "_Node | None", key: tuple[int, ...], block: BlockRef | None, last_access: int) -> None:
        self.parent = parent
        self.key = key  # the block_size token ids of the edge from the parent
        self.block = block
        self.children: dict[tuple[int, ...], _Node] = {}
        self.last_access = last_access
        self.checkpoint: int | None = None  # a window checkpoint id (hybrid models)
        self.digest = ROOT if parent is None else block_digest(parent.digest, key)  # its key in the hash chain


class PrefixCache:
    """Radix tree of cached full blocks over a ShardedBlockPool (see the module docstring).

    Args:
        pool: the blocks of every rank.
        checkpoints: None for a model whose cached blocks are all a prefix needs; an int N >= 1 for
            a hybrid model: matches stop at window checkpoints, of which at most N are kept.
        record_new: list every block the tree takes, with its key, for take_new().
    """

    def __init__(self, pool: ShardedBlockPool, *, checkpoints: int | None = None, record_new: bool = False) -> None:
        if checkpoints is not None and (isinstance(checkpoints, bool) or not isinstance(checkpoints, int) or checkpoints < 1):
            raise ValueError(f"checkpoints must be None or an int >= 1, got {checkpoints!r}")
        self.pool = pool
        self.max_checkpoints = checkpoints
        self._checkpoint_ids = itertools.count()
        self._checkpointed: set[_Node] = set()
        self._dropped: list[int] = []
        self.block_size = pool.block_size
        self._clock = itertools.count(1)
        self._root = _Node(None, (), None, 0)
        self.num_blocks = 0  # blocks owned by the tree
        self._new: list[tuple[bytes, BlockRef]] | None = [] if record_new else None

    def _keys(self, tokens, num_blocks: int):
        bs = self.block_size
        return (tuple(tokens[j * bs : (j + 1) * bs]) for j in range(num_blocks))

    def match(self, tokens) -> list[BlockRef]:
        """The blocks of the longest cached prefix of `tokens` made of full blocks (marks them used
        now, for LRU); with checkpoints, of the longest such prefix that ends at a checkpoint (or
        none). The caller must take its own reference (pool.incref) on blocks it keeps."""
        return self.match_checkpointed(tokens)[0]

    def match_checkpointed(self, tokens) -> tuple[list[BlockRef], int | None]:
        """match(tokens) and the id of the window checkpoint at its end (None without checkpoints
        or for no blocks)."""
        blocks, usable, checkpoint = self._walk(tokens)
        if self.max_checkpoints is None:
            return blocks, None
        return blocks[:usable], checkpoint

    def match_all(self, tokens) -> list[BlockRef]:
        """The blocks of the longest cached full-block prefix of `tokens`, not cut at a checkpoint
        (a hybrid model cannot start a sequence at its end without one: the KV store loads one)."""
        return self._walk(tokens)[0]

    def _walk(self, tokens) -> tuple[list[BlockRef], int, int | None]:
        """The blocks of the cached path of `tokens` (marked used now), how many end at its deepest
        checkpoint, and that checkpoint's id."""
        now = next(self._clock)
        node, blocks, usable, checkpoint = self._root, [], 0, None
        for key in self._keys(tokens, len(tokens) // self.block_size):
            node = node.children.get(key)
            if node is None:
                break
            node.last_access = now
            blocks.append(node.block)
            if node.checkpoint is not None:
                usable, checkpoint = len(blocks), node.checkpoint
        return blocks, usable, checkpoint

    def add_checkpoint(self, tokens, num_blocks: int) -> int | None:
        """A new window checkpoint id for the cached prefix of `num_blocks` full blocks of
        `tokens`, attached to its node; None where that prefix is not cached, already has one, or
        the tree keeps no checkpoints. Over the limit, the least recently used other checkpoint
        is dropped (take_dropped)."""
        if self.max_checkpoints is None or num_blocks < 1:
            return None
        node = self._root
        for key in self._keys(tokens, num_blocks):
            node = node.children.get(key)
            if node is None:
                return None
        if node.checkpoint is not None:
            return None
        node.checkpoint = next(self._checkpoint_ids)
        node.last_access = next(self._clock)
        self._checkpointed.add(node)
        while len(self._checkpointed) > self.max_checkpoints:
            self._drop_checkpoint(min(self._checkpointed - {node}, key=lambda n: n.last_access))
        return node.checkpoint

    def take_dropped(self) -> tuple[int, ...]:
        """The checkpoint ids dropped since the last call (the ranks may free them)."""
        dropped, self._dropped = tuple(self._dropped), []
        return dropped

    def checkpoint_digest(self, checkpoint: int) -> bytes | None:
        """The key (hash chain) of the node that holds window checkpoint `checkpoint`, None if dropped."""
        return next((n.digest for n in self._checkpointed if n.checkpoint == checkpoint), None)

    def drop_checkpoint(self, checkpoint: int) -> None:
        """Drop window checkpoint `checkpoint` (listed by take_dropped); unknown ids are ignored."""
        for node in [n for n in self._checkpointed if n.checkpoint == checkpoint]:
            self._drop_checkpoint(node)

    @property
    def num_checkpoints(self) -> int:
        return len(self._checkpointed)

    def _drop_checkpoint(self, node: _Node) -> None:
        self._dropped.append(node.checkpoint)
        node.checkpoint = None
        self._checkpointed.discard(node)

    def insert(self, tokens, blocks: list[BlockRef]) -> int:
        """Cache the full blocks of a sequence: `blocks[j]` holds tokens[j*bs:(j+1)*bs] for every
        full block j < min(len(blocks), len(tokens) // bs). Where the tree already caches a block
        for the same tokens it keeps its own (the caller's copy is freed when the caller lets go).
        Returns the number of blocks newly cached (each gains the tree's reference)."""
        now = next(self._clock)
        node, added = self._root, 0
        for j, key in enumerate(self._keys(tokens, min(len(blocks), len(tokens) // self.block_size))):
            child = node.children.get(key)
            if child is None:
                if self.pool.owner(j) != blocks[j].rank:
                    raise ValueError(f"block {j} is on rank {blocks[j].rank}, but the placement puts it on rank "
                                     f"{self.pool.owner(j)}")
                self.pool.incref(blocks[j])
                child = node.children[key] = _Node(node, key, blocks[j], now)
                if self._new is not None:
                    self._new.append((child.digest, blocks[j]))
                self.num_blocks += 1
                added += 1
            child.last_access = now
            node = child
        return added

    def take_new(self) -> list[tuple[bytes, BlockRef]]:
        """(key, block) of every block the tree took since the last call (record_new=True; else [])."""
        if self._new is None:
            return []
        new, self._new = self._new, []
        return new

    def match_digest(self, tokens, num_blocks: int) -> bytes | None:
        """The key of the cached prefix of `num_blocks` full blocks of `tokens` (ROOT for 0), or
        None where the tree does not hold it."""
        node = self._root
        for key in self._keys(tokens, num_blocks):
            node = node.children.get(key)
            if node is None:
                return None
        return node.digest

    def evictable(self, node: _Node) -> bool:
        return node is not self._root and not node.children and self.pool.refcount(node.block) == 1

    def evict(self, rank: int | None = None, num_free: int = 0) -> int:
        """Evict unreferenced leaves, least recently used first, until rank `rank`'s pool has
        `num_free` free blocks (rank None: evict everything evictable). Returns blocks freed."""
        def satisfied() -> bool:
            return rank is not None and self.pool.pools[rank].num_free >= num_free

        if satisfied():
            return 0
        heap = [(n.last_access, id(n), n) for n in self._nodes() if self.evictable(n)]
        heapq.heapify(heap)
        freed = 0
        while heap and not satisfied():
            _, _, node = heapq.heappop(heap)
            parent = node.parent
            del parent.children[node.key]
            self.num_blocks -= 1
            if node.checkpoint is not None:
                self._drop_checkpoint(node)
            freed += self.pool.decref(node.block)
            if self.evictable(parent):
                heapq.heappush(heap, (parent.last_access, id(parent), parent))
        return freed

    def clear(self) -> int:
        """Evict every block that no sequence uses. Returns blocks freed."""
        return self.evict(None)

    def _nodes(self):
        stack = list(self._root.children.values())
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            yield node

    def __repr__(self) -> str:
        return f"PrefixCache({self.num_blocks} blocks of {self.block_size} tokens)"
