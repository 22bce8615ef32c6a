"""The engine's second KV tier: prefix-cache blocks written through to a disk store and loaded back (treeattn.cache.store).

    ranks:   runner.block_store = RankKVStore(runner.cache, model, config.kv_store, config.kv_store_bytes, runner.windows)
             reports = runner.block_store.apply(StoreOps(saves, loads), rank)   # its own blocks, rank 0 the window checkpoints
    driver:  tier = StoreTier(directory, namespace, pool, prefix_cache, channel.run)
             tier.flush()            # after every step: blocks the prefix cache took go to the store
             tier.promote(scheduler) # before planning: waiting requests' blocks found on disk are loaded

Write-through: every block that enters the prefix cache (a prefill chunk's full blocks, a finished
sequence's) is written to the store by the rank that holds it, before the next step may evict or
reuse it. A restart -- or a crash: a block is on disk once the step after the one that computed it
is planned -- finds every such block; eviction from the arena costs nothing more. A waiting request
whose prompt's next blocks miss the arena but are on disk (the driver checks the files) gets them
loaded into freshly allocated blocks of the ranks that own them (each rank reads its own), inserted
into the prefix cache, so that its admission finds them as arena hits. A block that fails its
checks on a rank (corrupt, truncated, gone) is skipped with a warning: the prefix ends before it,
and the request computes the rest.

A block's payload is its arena bytes in the cache's own dtype (bfloat16 stays 16 bits, fp8 its
8-bit codes and float32 scales): disk bytes per token == arena bytes per token (+ a 64-byte header
per block). The namespace is the model's fingerprint (its configuration and a sample of every
weight tensor: model_fingerprint), the KV dtype and the arena's block shape: another model, dtype or
block size never matches. It holds no rank: a block's bytes are the same on any rank, so an engine
of any rank count reads any block (a store written with 2 ranks is read by 1, re-sharded).

A hybrid model (window and global layers, Gemma 3) starts a cached prefix only at a window
checkpoint (treeattn.cache.window): the window layers' last W - 1 rows at a block boundary, the same
on every rank. Rank 0 writes each checkpoint the ranks copy (after the step that copies it) to a
second namespace of the same directory, keyed by its boundary's block key; a lookup loads the
blocks up to the deepest boundary whose checkpoint is stored, then that checkpoint into every rank
under a new id of the prefix cache.

Refused: a hybrid linear model (no prefix cache; the store is off with a one-line warning), and
before any rank starts (ConfigError) speculate="draft" (the draft model's cache is not stored) and
prefix_cache=False.
"""

from __future__ import annotations

import logging
import time
import weakref
from dataclasses import dataclass

import torch

from treeattn.cache.paged import PagedKVCache
from treeattn.cache.store import DIGEST_SIZE, KVStore, chain_digests, namespace
from treeattn.engine.plan_message import StoreOps

logger = logging.getLogger(__name__)

FORMAT = "treeattn-kv-1"
"""The payload layout's version (part of every namespace)."""
SAMPLE = 4096
"""Elements of every weight tensor that model_fingerprint reads: its first, its last, and as many spread over it."""


def model_fingerprint(model) -> str:
    """A hex digest of the model's configuration, dtype and, for every tensor of its state_dict, name,
    shape, dtype and SAMPLE elements at its start, its end and spread over it (not every weight:
    fast for any model, and two checkpoints that differ share no such sample).

    >>> from treeattn.models.llama import LlamaConfig, random_model
    >>> c = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=1,
    ...                 head_dim=16, max_position_embeddings=128)
    >>> model_fingerprint(random_model(c, seed=0)) == model_fingerprint(random_model(c, seed=0))
    True
    >>> model_fingerprint(random_model(c, seed=0)) == model_fingerprint(random_model(c, seed=1))
    False
    """
    parts = [repr(model.config), str(model.dtype)]
    for name, tensor in model.state_dict().items():
        flat = tensor.detach().reshape(-1)
        stride = max(1, flat.numel() // SAMPLE)
        sample = torch.cat((flat[:SAMPLE], flat[-SAMPLE:], flat[::stride][:SAMPLE])).cpu().contiguous()
        parts.append((name, tuple(tensor.shape), str(tensor.dtype), sample.view(torch.uint8).numpy().tobytes().hex()))
    return namespace(*parts)


def window_namespace(block_namespace: str) -> str:
    """The namespace of a hybrid model's window checkpoints beside its blocks' (their layout follows
    from the model and the KV dtype, which the blocks' namespace holds)."""
    return namespace(block_namespace, "window checkpoints")


def cache_namespace(cache: PagedKVCache, fingerprint: str) -> str:
    """The store namespace of `cache`'s blocks for a model of `fingerprint`: its dtype and block shape."""
    block = (cache.arena.shape[0], cache.arena.shape[1], *cache.arena.shape[3:])
    return namespace(FORMAT, fingerprint, str(cache.dtype), block, cache.scales is not None)


@dataclass(frozen=True)
class StoreReport:
    """What one rank did with a StoreOps: blocks and bytes saved and loaded, seconds, and the
    (rank, index) of the loads that failed (absent or corrupt: not loaded)."""

    rank: int
    saved: int = 0
    saved_bytes: int = 0
    loaded: int = 0
    loaded_bytes: int = 0
    save_s: float = 0.0
    load_s: float = 0.0
    failed: tuple[tuple[int, int], ...] = ()


class RankKVStore:
    """One rank's side: its arena's blocks to and from the store's files.

    Args:
        cache: the rank's PagedKVCache.
        model: the rank's model (its fingerprint names the namespace).
        directory, max_bytes: the store's (EngineConfig.kv_store, kv_store_bytes).
    """

    def __init__(self, cache: PagedKVCache, model, directory: str, max_bytes: int | None, windows=None) -> None:
        self.cache, self.windows = cache, windows
        self.namespace = cache_namespace(cache, model_fingerprint(model))
        self.store = KVStore(directory, self.namespace, max_bytes=max_bytes)
        self.window_store = KVStore(directory, window_namespace(self.namespace),
                                    max_bytes=max_bytes) if windows is not None else None

    def _planes(self, index: int) -> list[torch.Tensor]:
        """Views of block `index`'s bytes: its keys/values (and an fp8 cache's scales), as uint8."""
        planes = [self.cache.arena.view(torch.uint8)[:, :, index]]
        if self.cache.scales is not None:
            planes.append(self.cache.scales.view(torch.uint8)[:, :, index])
        return planes

    def block_bytes(self, index: int) -> memoryview:
        """Block `index`'s payload: its bytes exactly as the arena holds them."""
        flat = torch.cat([p.reshape(-1) for p in self._planes(index)]).cpu()
        return memoryview(flat.numpy())

    @property
    def bytes_per_block(self) -> int:
        return sum(p.numel() for p in self._planes(0))

    def load_block(self, index: int, payload) -> None:
        """Copy a payload (block_bytes' layout) into block `index`."""
        flat = torch.frombuffer(payload, dtype=torch.uint8).to(self.cache.device)
        at = 0
        for plane in self._planes(index):
            plane.copy_(flat[at : at + plane.numel()].view(plane.shape))
            at += plane.numel()

    def apply(self, ops: StoreOps, rank: int) -> StoreReport:
        """Save and load this rank's blocks of `ops` ((rank, index, key) triples), and its window
        checkpoints (rank 0 writes them: every rank holds the same; every rank reads them)."""
        start = time.perf_counter()
        saved = saved_bytes = 0
        try:  # a full or unwritable disk loses the writes (a warning), never the step
            for owner, index, key in ops.saves:
                if owner == rank:
                    written = self.store.put(key, self.block_bytes(index))
                    saved, saved_bytes = saved + (written > 0), saved_bytes + written
            for checkpoint, _, key in ops.window_saves if rank == 0 else ():
                payload = self.windows.checkpoint_payload(checkpoint)  # None: dropped in the step that saved it
                saved_bytes += self.window_store.put(key, payload) if payload is not None else 0
            if saved_bytes and self.store.max_bytes is not None:
                self.store.evict()
        except OSError as exc:
            logger.warning("KV store: writing to %s failed (%s); blocks not stored", self.store.root, exc)
        middle = time.perf_counter()
        loaded, loaded_bytes, failed = self._load(ops.loads, rank)
        for checkpoint, position, key in ops.window_loads:
            payload = _read(self.window_store, key)
            if payload is None or not self.windows.load_checkpoint(checkpoint, position, payload):
                failed.append((-1, checkpoint))  # (-1, id): a window checkpoint that did not load
            else:
                loaded_bytes += len(payload)
        return StoreReport(rank, saved, saved_bytes, loaded, loaded_bytes, middle - start, time.perf_counter() - middle,
                           tuple(failed))

    def _load(self, loads, rank: int) -> tuple[int, int, list[tuple[int, int]]]:
        """Load this rank's blocks of `loads`: (blocks loaded, their bytes, (rank, index) of those that failed)."""
        loaded = loaded_bytes = 0
        failed = []
        for owner, index, key in loads:
            if owner != rank:
                continue
            payload = _read(self.store, key)
            if payload is None or len(payload) != self.bytes_per_block:
                if payload is not None:
                    logger.warning("KV store: block %s has %d bytes, %d expected; skipped", key.hex(), len(payload),
                                   self.bytes_per_block)
                failed.append((owner, index))
                continue
            self.load_block(index, payload)
            loaded, loaded_bytes = loaded + 1, loaded_bytes + len(payload)
        return loaded, loaded_bytes, failed


def _read(store: KVStore, key: bytes):
    """store.get(key), None (a warning) where the disk fails to read."""
    try:
        return store.get(key)
    except OSError as exc:
        logger.warning("KV store: reading %s failed (%s); block skipped", store.path(key), exc)
        return None


COUNTERS = ("arena_hit_blocks", "arena_miss_blocks", "store_hit_blocks", "store_miss_blocks", "store_failed_blocks",
            "store_saved_blocks", "store_saved_bytes", "store_loaded_bytes", "store_load_s", "store_save_s")
"""Engine.stats() keys of a store (treeattn.engine.kv_tier.StoreTier.stats)."""


class StoreTier:
    """The driver's side (see the module docstring).

    Args:
        directory: the store's directory; namespace: the ranks' (rank 0 reports it).
        pool, prefix_cache: the driver's ShardedBlockPool and PrefixCache (record_new=True; with
            checkpoints for a hybrid model, whose window checkpoints are stored too).
        run: sends a StoreOps to the ranks and returns their StoreReports (channel.run).
    """

    def __init__(self, directory: str, namespace: str, pool, prefix_cache, run) -> None:
        self.store = KVStore(directory, namespace)
        self.windows = KVStore(directory, window_namespace(namespace)) if prefix_cache.max_checkpoints is not None else None
        self.pool, self.prefix_cache, self.run = pool, prefix_cache, run
        self.counters = dict.fromkeys(COUNTERS, 0)
        self.counters.update(store_load_s=0.0, store_save_s=0.0)
        self._probed: weakref.WeakSet = weakref.WeakSet()

    def stats(self) -> dict:
        return dict(self.counters)

    def discard(self) -> None:
        """Forget the blocks not yet saved (the ranks that held them were restarted)."""
        self.prefix_cache.take_new()

    def flush(self, plan=None) -> None:
        """Save every block the prefix cache took since the last call that the store lacks, and the
        window checkpoints that `plan` (the step that just ran) had the ranks copy."""
        saves = tuple((block.rank, block.index, key) for key, block in self.prefix_cache.take_new() if key not in self.store)
        windows = []
        for _, _, checkpoint in getattr(plan, "window_saves", ()) if self.windows is not None else ():
            key = self.prefix_cache.checkpoint_digest(checkpoint)
            if key is not None and key not in self.windows:
                windows.append((checkpoint, 0, key))
        if saves or windows:
            start = time.perf_counter()
            self._count(self.run(StoreOps(saves, (), tuple(windows))))
            self.counters["store_save_s"] += time.perf_counter() - start

    def promote(self, scheduler) -> None:
        """Load the stored blocks of the waiting requests that may be admitted next."""
        room = scheduler.max_batch_size - len(scheduler.running)
        for seq in list(scheduler.waiting)[: max(room, 0)]:
            self._promote(seq.tokens[: len(seq.tokens) - 1], first=seq not in self._probed)
            self._probed.add(seq)

    def _promote(self, tokens, first: bool) -> None:
        """The blocks of `tokens`' full-block prefix past the arena's that are on disk, loaded into new
        blocks and into the prefix cache; for a hybrid model, up to the deepest boundary with a
        stored window checkpoint, which is loaded too."""
        bs, cache = self.pool.block_size, self.prefix_cache
        n = len(tokens) // bs
        path = cache.match_all(tokens)
        usable = len(cache.match(tokens))  # where a sequence may start now (path's end without checkpoints)
        keys = chain_digests(tokens, bs, n)
        end = len(path)
        while end < n and keys[end] in self.store:
            end += 1
        if self.windows is not None:  # the deepest boundary past `usable` that has a stored checkpoint
            end = next((t for t in range(end, usable, -1) if keys[t - 1] in self.windows), usable)
        if first:
            self.counters["arena_hit_blocks"] += usable
            self.counters["arena_miss_blocks"] += n - usable
            self.counters["store_miss_blocks"] += n - max(usable, end)
        if end <= usable:
            return
        good = self._load_blocks(tokens, path[:end], end, keys)
        if self.windows is not None and good == end:
            checkpoint = cache.add_checkpoint(tokens, end)
            if checkpoint is not None and self._load_window(checkpoint, end * bs, keys[end - 1]):
                cache.drop_checkpoint(checkpoint)
        cache.take_new()  # on disk already (flush ran before)

    def _load_blocks(self, tokens, path, end: int, keys) -> int:
        """Load blocks len(path)..end-1 of `tokens` (the arena holds `path`) into new blocks and the
        prefix cache; returns how many leading blocks of `tokens` the cache then holds."""
        cache, pool = self.prefix_cache, self.pool
        for block in path:  # pinned: making room must not evict the prefix the loads extend
            pool.incref(block)
        loaded = []
        for j in range(len(path), end):
            rank = pool.owner(j)
            if pool.pools[rank].num_free == 0:
                cache.evict(rank, 1)
            if pool.pools[rank].num_free == 0:
                break
            loaded.append(pool.allocate(j))
        failed = set()
        if loaded:
            start = time.perf_counter()
            failed = self._count(self.run(StoreOps((), tuple((b.rank, b.index, keys[len(path) + i]) for i,
                                                             b in enumerate(loaded)))))
            self.counters["store_load_s"] += time.perf_counter() - start
        good = next((i for i, b in enumerate(loaded) if (b.rank, b.index) in failed), len(loaded))
        self.counters["store_hit_blocks"] += good  # the blocks after a failed one are loaded but not used
        cache.insert(tokens[: (len(path) + good) * self.pool.block_size], path + loaded[:good])
        for block in path + loaded:
            pool.decref(block)
        return len(path) + good

    def _load_window(self, checkpoint: int, position: int, key: bytes) -> bool:
        """Have every rank load the window checkpoint `key` as `checkpoint`; True if one failed."""
        start = time.perf_counter()
        failed = self._count(self.run(StoreOps(window_loads=((checkpoint, position, key),))))
        self.counters["store_load_s"] += time.perf_counter() - start
        return bool(failed)

    def _count(self, reports) -> set[tuple[int, int]]:
        failed = set()
        for r in reports:
            self.counters["store_saved_blocks"] += r.saved
            self.counters["store_saved_bytes"] += r.saved_bytes
            self.counters["store_loaded_bytes"] += r.loaded_bytes
            self.counters["store_failed_blocks"] += len(r.failed)
            failed.update(r.failed)
        return failed


def store_refusal(linear_layers, tp: int = 1) -> str | None:
    """Why the store is off for a model (one line), or None when it runs."""
    if linear_layers:
        return "its linear-attention layers keep per-sequence states and no prefix cache"
    if tp > 1:
        return "tensor-parallel ranks hold different heads of one block"
    return None


assert DIGEST_SIZE == 16  # StoreOps sends a key as four int32 words
