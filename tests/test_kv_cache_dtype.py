"""A KV cache stored in another dtype than the model's (EngineConfig.kv_cache_dtype, --kv-cache-dtype).

Exactness: one engine layer (PagedBatch: the new keys written, then every read path: the paged CPU
kernel, the gathered fallback, run-by-run views, shared prefixes, a prefill chunk) over a bfloat16
or float16 cache with float32 queries equals float64 attention over the values the cache holds
(the dequantized cache), up to float32 accumulation; on one rank and on two (real gloo, each rank
its blocks, the states combined). The engine: bfloat16 KV against float32 KV on a tiny model (the
agreement is printed, not asserted: rounding the keys may legitimately flip a near-tie), and the
bfloat16 cache read by every path (kernel or not, static steps, two ranks, ring prefill) giving one
set of greedy tokens; a 16-bit cache takes half the bytes per token; what cannot run it is refused.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import treeattn as ta
from treeattn.cache.blocks import BlockRef
from treeattn.cache.paged import PagedKVCache
from treeattn.engine import batch as engine_batch, shared_prefix
from treeattn.engine.config import ConfigError, EngineConfig, resolve_kv_cache_dtype
from treeattn.engine.scheduler import Chunk, StepPlan
from treeattn.models.attention import LocalAttention, attention_backend
from treeattn.models.llama import LlamaConfig, random_model
from treeattn.ops import paged_decode

KERNEL = paged_decode.kernel_takes(torch.bfloat16, "cpu", torch.float32)
# float32 accumulation of a few dozen products against float64 on the same (exactly widened) values.
TOL = 1e-5

BS, HKV, HQ, D = 4, 2, 4, 16


def _chunks(owner):
    """A decode step: 3 sequences sharing a 6-block document (2 of them also an instruction of 2
    blocks), one of them with 2 drafts; one sequence sharing nothing; one prefill chunk of 7 tokens
    after a cached block. owner(block id) -> the rank holding it."""
    refs = lambda ids: tuple(BlockRef(owner(i), i) for i in ids)  # noqa: E731
    doc, instruction = list(range(6)), [6, 7]
    return (Chunk(0, (1,), 25, refs(doc + [20]), None), Chunk(1, (1, 2, 3), 34, refs(doc + instruction + [21, 23]), None, 2),
            Chunk(2, (1,), 32, refs(doc + instruction + [22]), None), Chunk(3, (1, 1), 9, refs([30, 31, 32]), None, 1),
            Chunk(4, (1,) * 7, 4, refs([33, 34, 35]), None))


def _step(kv_dtype, path, monkeypatch, rank=0, combine=(None, "allreduce", 1), owner=lambda b: 0, backend=None):
    """One layer of a PagedBatch step over a cache of kv_dtype (float32 compute): returns the
    chunks, the float32 queries, the output (T, Hq, D) and the cache."""
    g = torch.Generator().manual_seed(0)
    cache = PagedKVCache(num_layers=1, num_kv_heads=HKV, head_dim=D, num_blocks=40, block_size=BS, dtype=kv_dtype,
                         compute_dtype=torch.float32)
    cache.arena.copy_(torch.randn(cache.arena.shape, generator=g))  # the same cached keys on every rank (each reads its own)
    chunks = _chunks(owner)
    T = sum(len(c.tokens) for c in chunks)
    q = torch.randn(1, T, HQ, D, generator=g)
    k_new, v_new = torch.randn(1, T, HKV, D, generator=g), torch.randn(1, T, HKV, D, generator=g)
    monkeypatch.setattr(engine_batch, "COPY_FREE_MIN_KEYS", 0 if path == "runs" else 1 << 40)
    monkeypatch.setattr(shared_prefix, "SHARE_MIN_SAVED_KEYS", 1 if path == "shared" else 1 << 40)
    if path != "kernel":
        monkeypatch.setattr(engine_batch, "kernel_takes", lambda *args: False)
    batch = engine_batch.PagedBatch(StepPlan(chunks), rank, cache, backend or LocalAttention(), combine=combine)
    assert (batch.groups[0].paged is not None) == (path == "kernel")
    assert (batch.groups[0].shared is not None) == (path == "shared")
    k, v, pos = batch.kv_store(0, k_new, v_new)
    return chunks, q, batch.attend(q, k, v, q_pos=None, kv_pos=pos, window=None)[0], cache


def _check_against_float64(chunks, q, out, keys, values):
    """out against float64 attention of each chunk's queries over its blocks' stored keys (keys,
    values: float64 (blocks, BS, Hkv, D), the dequantized cache)."""
    row = 0
    for c in chunks:
        n, end = len(c.tokens), c.start + len(c.tokens)
        ids = torch.tensor([ref.index for ref in c.blocks])
        k_seq, v_seq = keys[ids].flatten(0, 1)[None, :end], values[ids].flatten(0, 1)[None, :end]
        expected, _ = ta.reference_attention(q[:, row : row + n].double(), k_seq, v_seq, causal=True,
                                             q_pos=torch.arange(c.start, end)[None], kv_pos=torch.arange(end)[None])
        torch.testing.assert_close(out[row : row + n].double(), expected[0], rtol=TOL, atol=TOL)
        row += n


PATHS = ["kernel", "gather", "runs", "shared"]


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("path", PATHS)
def test_one_layer_matches_float64_on_the_stored_cache(kv_dtype, path, monkeypatch):
    if path == "kernel" and not KERNEL:
        pytest.skip("numba is not installed")
    chunks, q, out, cache = _step(kv_dtype, path, monkeypatch)
    assert cache.arena.dtype == kv_dtype and out.dtype == torch.float32
    keys, values = cache.blocks(0)
    _check_against_float64(chunks, q, out, keys.double(), values.double())
    # What the cache holds is the new keys rounded once: the first chunk's token (position 25) sits
    # in slot 1 of block 20.
    g = torch.Generator().manual_seed(0)
    torch.randn(cache.arena.shape, generator=g), torch.randn(1, q.shape[1], HQ, D, generator=g)
    k_new = torch.randn(1, q.shape[1], HKV, D, generator=g)
    assert torch.equal(keys[20, 1], k_new[0, 0].to(kv_dtype))


def _two_ranks(rank, world_size, paths):
    for path in paths:
        with pytest.MonkeyPatch.context() as monkeypatch:
            chunks, q, out, cache = _step(torch.bfloat16, path, monkeypatch, rank=rank, combine=(None, "allreduce", 1),
                                          owner=lambda b: b % 2, backend=attention_backend("tree", method="allreduce"))
        mine = cache.arena[0].float()  # (2, blocks, BS, Hkv, D): this rank's blocks are those b % 2 == rank
        every = [torch.empty_like(mine) for _ in range(world_size)]
        dist.all_gather(every, mine)
        stored = torch.stack([every[b % 2][:, b] for b in range(mine.shape[1])], dim=1).double()  # block b from its rank
        _check_against_float64(chunks, q, out, stored[0], stored[1])
    return True


def test_two_ranks_match_float64_on_the_stored_cache():
    """Each rank stores its blocks (b % 2) in bfloat16 and reads them by the paged kernel (or the
    gathered path without numba), the shared-prefix reads, or gathers; the states combine across
    real gloo ranks (tree_decode's combine; the prefill chunk by tree_decode) into float64
    attention over every rank's stored blocks."""
    assert ta.spawn(_two_ranks, 2, (["kernel"] if KERNEL else []) + ["shared", "gather"]) == [True, True]


# ---------------------------------------------------------------- the engine

CONFIG = LlamaConfig(vocab_size=97, hidden_size=48, intermediate_size=64, num_layers=2, num_heads=6, num_kv_heads=2,
                     head_dim=8, max_position_embeddings=512)
PROMPTS = [list(range(5, 29)) + [40, 41], list(range(5, 29)) + [50], list(range(30, 33)), list(range(7, 70))]


def _tokens(model, **options):
    options = {"nproc": 1, "decode": "tree", "max_batch_size": 4, "block_size": 8, **options}
    with ta.Engine(model, **options) as engine:
        tokens = [r.token_ids for r in engine.generate(PROMPTS, max_new_tokens=6, temperature=0.0)]
        return tokens, engine.rank_measurements()


def test_engine_bfloat16_cache_every_path_gives_one_answer(monkeypatch):
    """The bfloat16 cache read by the kernel, by the gathered / run-by-run reads, by static steps,
    on two ranks with ring prefill: the same greedy tokens (the same stored values, float32 sums);
    against the float32 cache the agreement is printed. The cache takes half the bytes."""
    model = random_model(CONFIG, seed=3)
    f32, m32 = _tokens(model, kv_cache_dtype="float32")
    bf16, m16 = _tokens(model, kv_cache_dtype="bfloat16")
    same = sum(a == b for x, y in zip(f32, bf16) for a, b in zip(x, y))
    print(f"bfloat16 KV vs float32 KV: {same}/{sum(map(len, f32))} greedy tokens equal")
    assert m16[0].kv_bytes * 2 == m32[0].kv_bytes
    assert _tokens(model, kv_cache_dtype="bfloat16", decode_step="static")[0] == bf16
    assert _tokens(model, kv_cache_dtype="bfloat16", nproc=2, prefill="ring", prefill_chunk=32)[0] == bf16
    monkeypatch.setattr(engine_batch, "kernel_takes", lambda *args: False)
    assert _tokens(model, kv_cache_dtype="bfloat16")[0] == bf16


def test_kv_cache_dtype_is_checked_and_resolved():
    assert resolve_kv_cache_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert resolve_kv_cache_dtype("float16", torch.float32) == torch.float16
    with pytest.raises(ConfigError, match="kv_cache_dtype must be one of"):
        EngineConfig(kv_cache_dtype="fp8")
    gemma = LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2, num_kv_heads=1,
                        head_dim=16, max_position_embeddings=128, layer_windows=(8, None))
    with pytest.raises(ConfigError, match=r"kv_cache_dtype='bfloat16' \(--kv-cache-dtype\) does not run the sliding-window"):
        ta.Engine(random_model(gemma, seed=0), kv_cache_dtype="bfloat16")
