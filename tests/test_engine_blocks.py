"""Block pools, the radix prefix cache and the continuous-batching scheduler (host side, no ranks)."""

from __future__ import annotations

import pytest

from treeattn.cache.blocks import BlockPool, BlockRef, ShardedBlockPool
from treeattn.cache.prefix import PrefixCache
from treeattn.engine.request import SamplingParams
from treeattn.engine.scheduler import Scheduler


def test_block_pool_counts_references_and_refuses_double_free():
    pool = BlockPool(2)
    a = pool.allocate()
    pool.incref(a)
    assert not pool.decref(a) and pool.decref(a) and pool.num_free == 2
    with pytest.raises(RuntimeError, match="double free"):
        pool.decref(a)
    pool.allocate(), pool.allocate()
    with pytest.raises(RuntimeError, match="no free block"):
        pool.allocate()


@pytest.mark.parametrize("placement, owners", [("contiguous", [0, 0, 0, 1, 1, 1, 2, 2, 2]), ("interleaved", [0, 1, 2] * 3)])
def test_placement_of_logical_blocks(placement, owners):
    pool = ShardedBlockPool(world_size=3, blocks_per_rank=3, block_size=4, placement=placement)
    assert [pool.owner(j) for j in range(9)] == owners
    assert pool.max_tokens_per_sequence == 36
    assert pool.blocks_needed(0, 9) == [3, 3, 3]


def test_contiguous_spans_of_max_context():
    """span_blocks = the p-th part of the longest sequence: every sequence that long is split evenly,
    and the pool holds several such sequences (span_blocks < blocks_per_rank)."""
    pool = ShardedBlockPool(world_size=3, blocks_per_rank=6, block_size=4, placement="contiguous", span_blocks=2)
    assert [pool.owner(j) for j in range(6)] == [0, 0, 1, 1, 2, 2]
    assert pool.max_tokens_per_sequence == 24
    for _ in range(3):  # three sequences of 6 blocks fit: 2 blocks of each on every rank
        assert pool.can_allocate(pool.blocks_needed(0, 6))
        [pool.allocate(j) for j in range(6)]
    assert pool.num_free == 0
    with pytest.raises(ValueError, match="span_blocks must be at most blocks_per_rank=6, got 7"):
        ShardedBlockPool(world_size=3, blocks_per_rank=6, block_size=4, placement="contiguous", span_blocks=7)


def _pool(p=2, blocks=4, bs=2, placement="interleaved"):
    return ShardedBlockPool(world_size=p, blocks_per_rank=blocks, block_size=bs, placement=placement)


def test_prefix_cache_matches_full_blocks_and_evicts_lru_leaves_only():
    pool = _pool()
    tree = PrefixCache(pool)
    a = [pool.allocate(j) for j in range(3)]
    tree.insert([1, 2, 3, 4, 5, 6, 7], a)  # 3 full blocks (7 tokens: the 4th block is partial, not cached)
    assert tree.num_blocks == 3 and all(pool.refcount(b) == 2 for b in a)
    for block in a:  # the sequence ends: the tree alone holds the blocks
        pool.decref(block)
    assert tree.match([1, 2, 3, 4, 9, 9]) == a[:2]
    assert tree.match([1, 2, 3]) == a[:1]  # a partial block never matches
    assert tree.match([7, 7]) == []
    b = [a[0], pool.allocate(1)]  # a second branch sharing block 0
    pool.incref(a[0])
    tree.insert([1, 2, 8, 8], b)
    tree.match([1, 2, 3, 4, 5, 6])  # touch branch a: branch b is now least recently used
    pool.decref(a[0]), pool.decref(b[1])
    freed = tree.evict(rank=1, num_free=pool.pools[1].num_free + 1)
    assert freed == 1 and tree.match([1, 2, 8, 8]) == [a[0]]  # the LRU leaf went, the shared root block stayed
    pool.incref(a[2])  # a sequence still uses the deepest block: nothing on its path can go
    assert tree.clear() == 0 and tree.num_blocks == 3
    pool.decref(a[2])
    assert tree.clear() == 3 and pool.num_free == pool.num_blocks and tree.num_blocks == 0


def test_prefix_cache_refuses_a_block_on_the_wrong_rank():
    pool = _pool()
    with pytest.raises(ValueError, match="placement puts it on rank 0"):
        PrefixCache(pool).insert([1, 2], [BlockRef(1, 0)])


def _run(scheduler: Scheduler, next_token=lambda seq_id, step: 7 + seq_id, max_steps=1000):
    """Drive the scheduler with fake model outputs; returns (plans, finished sequences)."""
    plans, finished = [], []
    for step in range(max_steps):
        if not scheduler.has_work:
            return plans, finished
        plan = scheduler.schedule()
        plans.append(plan)
        sampled = {c.seq_id: [next_token(c.seq_id, step)] for c in plan.chunks if c.sample is not None}
        finished += [seq for seq, _, reason in scheduler.complete(plan, sampled) if reason]
    raise AssertionError("the scheduler did not finish")


def test_scheduler_batches_decodes_chunks_prefills_and_frees_every_block():
    pool = _pool(p=2, blocks=16, bs=4)
    s = Scheduler(pool, max_batch_size=8, prefill_chunk=8, prefix_cache=None)
    seqs = [s.add(list(range(n)), SamplingParams(max_new_tokens=3), frozenset()) for n in (3, 20, 5)]
    plans, finished = _run(s)
    assert {q.seq_id for q in finished} == {0, 1, 2} and all(len(q.generated) == 3 for q in seqs)
    for plan in plans:
        assert sum(len(c.tokens) for c in plan.chunks if len(c.tokens) > 1) <= 8  # the prefill budget
        lengths = [len(c.tokens) for c in plan.chunks]
        assert lengths == sorted(lengths, key=lambda n: n > 1)  # single tokens first
    first = plans[0]
    assert [len(c.tokens) for c in first.chunks] == [3, 5]  # the 20-token prompt took what was left of the budget
    assert any(len(c.tokens) == 1 and len(p.chunks) > 1 for p in plans for c in p.chunks)  # decode beside a prefill
    assert pool.num_free == pool.num_blocks


def test_scheduler_preempts_the_youngest_and_completes_everything_that_fits_alone():
    pool = _pool(p=2, blocks=3, bs=2)  # 12 tokens in all
    tree = PrefixCache(pool)
    s = Scheduler(pool, max_batch_size=4, prefill_chunk=64, prefix_cache=tree)
    seqs = [s.add([i, i + 1, i + 2], SamplingParams(max_new_tokens=8, ignore_eos=True), frozenset()) for i in range(3)]
    plans, finished = _run(s, next_token=lambda seq_id, step: 1)
    assert len(finished) == 3 and all(len(q.generated) == 8 for q in seqs)
    assert sum(q.preemptions for q in seqs) > 0
    tree.clear()
    assert pool.num_free == pool.num_blocks


def test_scheduler_reuses_a_cached_prefix():
    pool = _pool(p=2, blocks=8, bs=2)
    tree = PrefixCache(pool)
    s = Scheduler(pool, max_batch_size=4, prefill_chunk=64, prefix_cache=tree)
    first = s.add([5, 6, 7, 8, 9], SamplingParams(max_new_tokens=2), frozenset())
    _run(s)
    second = s.add([5, 6, 7, 8, 1, 2], SamplingParams(max_new_tokens=2), frozenset())
    plans, _ = _run(s)
    assert first.cached_prompt_tokens == 0 and second.cached_prompt_tokens == 4
    assert plans[0].chunks[0].start == 4 and plans[0].chunks[0].tokens == (1, 2)
    tree.clear()
    assert pool.num_free == pool.num_blocks


from hypothesis import given, settings, strategies as st  # noqa: E402


@settings(max_examples=60, deadline=None)
@given(p=st.integers(1, 3), blocks=st.integers(2, 6), bs=st.integers(1, 4),
       placement=st.sampled_from(["contiguous", "interleaved"]),
       prefix=st.booleans(), batch=st.integers(1, 5), chunk=st.integers(1, 9), data=st.data())
def test_every_request_that_fits_alone_completes_without_leaks(p, blocks, bs, placement, prefix, batch, chunk, data):
    pool = ShardedBlockPool(world_size=p, blocks_per_rank=blocks, block_size=bs, placement=placement)
    tree = PrefixCache(pool) if prefix else None
    s = Scheduler(pool, max_batch_size=batch, prefill_chunk=chunk, prefix_cache=tree)
    fits = pool.max_tokens_per_sequence
    seqs = []
    for _ in range(data.draw(st.integers(1, 8))):
        n = data.draw(st.integers(1, fits - 1))
        prompt = data.draw(st.lists(st.integers(0, 2), min_size=n, max_size=n))  # few ids: shared prefixes are common
        new = data.draw(st.integers(1, fits - n))
        seqs.append(s.add(prompt, SamplingParams(max_new_tokens=new), frozenset()))
    _, finished = _run(s, next_token=lambda seq_id, step: (seq_id + step) % 3, max_steps=5000)
    assert sorted(q.seq_id for q in finished) == [q.seq_id for q in seqs]
    assert all(len(q.generated) == q.params.max_new_tokens for q in seqs)
    if tree is not None:
        tree.clear()
    assert pool.num_free == pool.num_blocks
