"""The sequence-sharded KV cache: placement policies and per-rank block storage (single process)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from treeattn.cache import (
    INVISIBLE_POSITION,
    PAD_POSITION,
    ContiguousPlacement,
    InterleavedPlacement,
    ShardedKVCache,
    make_placement,
)

placements = st.sampled_from(["contiguous", "interleaved"])


@settings(max_examples=60, deadline=None)
@given(kind=placements, capacity=st.integers(1, 300), world=st.integers(1, 6), block=st.integers(1, 40))
def test_placement_partitions_slots_and_fills_each_rank_in_order(kind, capacity, world, block):
    placement = make_placement(kind, capacity, world, block)
    slots = torch.arange(capacity)
    owner = placement.owner(slots)
    local = placement.local_slot(slots)
    assert int(owner.min()) >= 0 and int(owner.max()) < world
    total = 0
    for rank in range(world):
        mine = local[owner == rank]
        # the rank's slots are exactly 0, 1, 2, ... in increasing global order: the used part is a prefix
        assert torch.equal(mine, torch.arange(mine.numel()))
        assert placement.local_capacity(rank) == mine.numel()
        total += mine.numel()
        for length in {0, 1, capacity // 3, capacity // 2, capacity - 1, capacity}:
            assert placement.local_length(rank, length) == int((owner[:length] == rank).sum())
    assert total == capacity


def test_contiguous_gives_each_rank_one_span_and_interleaved_deals_blocks():
    contiguous = ContiguousPlacement(10, 3, 2)
    assert contiguous.owner(torch.arange(10)).tolist() == [0, 0, 0, 0, 1, 1, 1, 1, 2, 2]
    interleaved = InterleavedPlacement(10, 3, 2)
    assert interleaved.owner(torch.arange(10)).tolist() == [0, 0, 1, 1, 2, 2, 0, 0, 1, 1]
    assert interleaved.local_slot(torch.arange(10)).tolist() == [0, 1, 0, 1, 0, 1, 2, 3, 2, 3]


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(kind="striped"), ValueError, "placement must be one of"),
        (dict(capacity=0), ValueError, "capacity must be >= 1"),
        (dict(world_size=0), ValueError, "world_size must be >= 1"),
        (dict(block_size=2.5), TypeError, "block_size must be an int"),
    ],
)
def test_placement_rejects_bad_arguments(kwargs, error, match):
    args = dict(kind="contiguous", capacity=8, world_size=2, block_size=4) | kwargs
    with pytest.raises(error, match=match):
        make_placement(args["kind"], args["capacity"], args["world_size"], args["block_size"])


def _caches(placement, world=3, capacity=23, block=4, batch=2, layers=2):
    return [
        ShardedKVCache(num_layers=layers, num_kv_heads=2, head_dim=3, capacity=capacity, batch_size=batch,
                       placement=placement, block_size=block, rank=r, world_size=world)
        for r in range(world)
    ]


@pytest.mark.parametrize("placement", ["contiguous", "interleaved"])
def test_shards_hold_every_token_once_with_its_position(placement):
    """Write tokens in uneven pieces on every rank; the union of the shards is the whole sequence."""
    caches = _caches(placement)
    full_k = torch.randn(2, 2, 20, 2, 3)  # (layer, B, S, Hkv, D)
    full_v = torch.randn(2, 2, 20, 2, 3)
    positions = torch.stack([torch.arange(20), torch.arange(20) - 3])  # sequence 1 is left-padded by 3
    positions[1, :3] = PAD_POSITION
    start = 0
    for size in (7, 1, 1, 5, 6):
        for cache in caches:
            slots = cache.extend(positions[:, start:start + size])
            for layer in range(2):
                update = cache.update(slots, slots.owned)  # every rank sees all new tokens, stores its own
                k, v, kv_pos = update(layer, full_k[layer, :, start:start + size], full_v[layer, :, start:start + size])
                assert k.shape[1] == v.shape[1] == kv_pos.shape[1] == cache.local_length
        start += size
    for layer in range(2):
        ks, vs, ps = zip(*[(*c.layer(layer), c.kv_pos) for c in caches])
        k, v, pos = torch.cat(ks, 1), torch.cat(vs, 1), torch.cat(ps, 1)
        order = torch.argsort(pos[0])  # sequence 0 has no padding: its positions are the global slots
        assert torch.equal(k[:, order], full_k[layer]) and torch.equal(v[:, order], full_v[layer])
        expected = positions.clone()
        expected[1, :3] = INVISIBLE_POSITION
        assert torch.equal(pos[:, order], expected)
    assert sum(c.local_length for c in caches) == 20
    assert all(c.length == 20 for c in caches)


def test_views_are_not_copies_and_growth_does_not_move_old_tokens():
    cache = ShardedKVCache(num_layers=1, num_kv_heads=1, head_dim=4, capacity=64, block_size=8)
    slots = cache.extend(torch.arange(10))
    cache.write(0, slots, torch.ones(1, 10, 1, 4), torch.ones(1, 10, 1, 4))
    k_before, _ = cache.layer(0)
    slots = cache.extend(torch.arange(10, 11))
    cache.write(0, slots, torch.zeros(1, 1, 1, 4), torch.zeros(1, 1, 1, 4))
    k_after, _ = cache.layer(0)
    assert k_after.data_ptr() == k_before.data_ptr()  # same storage: a view, never re-allocated
    assert k_after.shape[1] == 11 and k_after.is_contiguous()
    assert cache.blocks_used == 2 and cache.num_blocks == 8


def test_capacity_error_is_raised_before_any_state_changes():
    cache = ShardedKVCache(num_layers=1, num_kv_heads=1, head_dim=2, capacity=12, rank=1, world_size=2, block_size=4)
    cache.extend(torch.arange(10))
    before = (cache.length, cache.local_length, cache.kv_pos.clone())
    with pytest.raises(ValueError, match=r"KV cache full: capacity is 12 tokens, 10 are in use, cannot add 3"):
        cache.extend(torch.arange(10, 13))
    assert (cache.length, cache.local_length) == before[:2] and torch.equal(cache.kv_pos, before[2])


def test_truncate_forgets_the_tail():
    cache = ShardedKVCache(num_layers=1, num_kv_heads=1, head_dim=2, capacity=16, placement="interleaved", block_size=2, rank=0,
                           world_size=2)
    cache.extend(torch.arange(9))
    assert cache.local_length == 5  # blocks 0, 2 and the first slot of block 4
    cache.truncate(4)
    assert (cache.length, cache.local_length) == (4, 2)
    assert cache.kv_pos.tolist() == [[0, 1]]
    with pytest.raises(ValueError, match="length must be an int in"):
        cache.truncate(5)


def test_nbytes_counts_tokens_in_use():
    cache = ShardedKVCache(num_layers=3, num_kv_heads=2, head_dim=8, capacity=100, batch_size=2, dtype=torch.bfloat16)
    cache.extend(torch.arange(10))
    assert cache.nbytes() == 2 * 10 * (3 * 2 * 2 * 8 * 2 + 8)
    assert cache.nbytes_reserved() >= cache.nbytes()


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda c: c.extend(torch.arange(3, dtype=torch.int32)), TypeError, "positions must be int64"),
        (lambda c: c.extend(torch.zeros(3, 4, dtype=torch.int64)), ValueError, r"positions must have shape \(S,\) or \(B=2, S\)"),
        (lambda c: c.write(0, c.extend(torch.arange(2)), torch.zeros(2, 3, 2, 4), torch.zeros(2, 3, 2, 4)), ValueError,
         r"k must have shape .* \(2, 2, 2, 4\)"),
        (lambda c: c.write(0, c.extend(torch.arange(2)), torch.zeros(2, 2, 2, 4, dtype=torch.float64), torch.zeros(2, 2, 2, 4)),
         TypeError, "cache's dtype"),
        (lambda c: c.layer(5), ValueError, r"layer must be an int in \[0, 2\)"),
    ],
)
def test_bad_input_names_the_argument(call, error, match):
    cache = ShardedKVCache(num_layers=2, num_kv_heads=2, head_dim=4, capacity=16, batch_size=2)
    with pytest.raises(error, match=match):
        call(cache)


def test_constructor_rejects_bad_arguments():
    with pytest.raises(ValueError, match=r"rank must be an int in \[0, world_size=2\)"):
        ShardedKVCache(num_layers=1, num_kv_heads=1, head_dim=2, capacity=4, rank=2, world_size=2)
    with pytest.raises(ValueError, match="num_kv_heads must be >= 1"):
        ShardedKVCache(num_layers=1, num_kv_heads=0, head_dim=2, capacity=4)
    with pytest.raises(TypeError, match="dtype must be a floating"):
        ShardedKVCache(num_layers=1, num_kv_heads=1, head_dim=2, capacity=4, dtype=torch.int64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_a_window_rings_one_row_writes_are_its_batched_writes(dtype):
    """A decode step writes a window ring's one new row at a plain index (_Ring._row); the ring's rows, positions and
    held range are those of writing the same rows through the index tensors of a longer write (_rows), including a
    restart at 0 and a rollback to an earlier position."""
    from treeattn.cache.window import _Ring

    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(20, 2, 4, generator=g), torch.randn(20, 2, 4, generator=g)
    one, batched = _Ring(5, k, dtype, torch.float32), _Ring(5, k, dtype, torch.float32)
    for start, n in ((0, 3), (3, 4), (7, 1), (8, 6), (5, 2), (0, 2), (2, 1)):  # (5, 2): a rollback; (0, 2): a restart
        for i in range(n):
            one.write(start + i, k[start + i : start + i + 1], v[start + i : start + i + 1])
        if n == 1:  # the batched ring's own single write would take the plain index too: force the index tensors
            at = batched._rows(start, 1)
            batched.k[at], batched.v[at] = k[start:start + 1].to(dtype).to(batched.k.dtype), v[start:start + 1].to(dtype).to(
                batched.v.dtype)
        else:
            batched.write(start, k[start : start + n], v[start : start + n])
        assert (one.first, one.end) == (batched.first, batched.end)
        assert torch.equal(one.pos, batched.pos) and torch.equal(one.k, batched.k) and torch.equal(one.v, batched.v)
