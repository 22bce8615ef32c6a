"""A KV cache stored in another dtype than the model's (EngineConfig.kv_cache_dtype, --kv-cache-dtype).

Exactness: one engine layer (PagedBatch: the new keys written, then every read path: the paged CPU
kernel, the gathered fallback, run-by-run views, shared prefixes, a prefill chunk) over a bfloat16,
float16 or fp8_e4m3 cache with float32 queries equals float64 attention over the values the cache
holds (the dequantized cache: fp8 codes times their scales), up to float32 accumulation; on one
rank and on two (real gloo, each rank its blocks, the states combined). fp8's quantization itself:
power-of-two scales per token and KV head, e4m3's rounding bound, non-finite values kept non-finite. The engine: bfloat16 KV
against float32 KV on a tiny model (the
agreement is printed, not asserted: rounding the keys may legitimately flip a near-tie), and the
bfloat16 cache read by every path (kernel or not, static steps, two ranks, ring prefill) giving one
set of greedy tokens; a 16-bit cache takes half the bytes per token; a hybrid model's window layers
in the cache's dtype (what a float32 ring holds when fed the stored values; checkpoints bit for bit);
what cannot run it is refused.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import treeattn as ta
from treeattn.cache.blocks import BlockRef
from treeattn.cache.paged import PagedKVCache
from treeattn.engine.worker import batch as engine_batch, shared_prefix
from treeattn.engine.config import ConfigError, EngineConfig, resolve_kv_cache_dtype
from treeattn.engine.scheduler import Chunk, StepPlan
from treeattn.models.attention import LocalAttention, attention_backend
from treeattn.models.llama import LlamaConfig, random_model
from treeattn.ops import paged_decode
from treeattn.ops.fp8 import FP8, dequantize_fp8, quantize_fp8

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
    cached = torch.randn(cache.arena.shape, generator=g)  # the same cached keys on every rank (each reads its own)
    if cache.scales is None:
        cache.arena.copy_(cached)
    else:  # fp8: codes and a scale per token and head, magnitudes spread over 2**-8 .. 2**8
        codes, scales = quantize_fp8(cached * torch.exp2(torch.randint(-8, 9, cached.shape[:-1], generator=g))[..., None])
        cache.arena.view(torch.uint8).copy_(codes.view(torch.uint8))
        cache.scales.copy_(scales)
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


def _stored(cache, layer=0):
    """The values cache holds in `layer`, float64 (blocks, BS, Hkv, D) keys and values (fp8: codes times scales)."""
    keys, values = cache.blocks(layer)
    if cache.scales is not None:
        k_scales, v_scales = cache.block_scales(layer)
        keys, values = dequantize_fp8(keys, k_scales), dequantize_fp8(values, v_scales)
    return keys.double(), values.double()


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float16, FP8])
@pytest.mark.parametrize("path", PATHS)
def test_one_layer_matches_float64_on_the_stored_cache(kv_dtype, path, monkeypatch):
    if path == "kernel" and not KERNEL:
        pytest.skip("numba is not installed")
    chunks, q, out, cache = _step(kv_dtype, path, monkeypatch)
    assert cache.arena.dtype == kv_dtype and out.dtype == torch.float32
    keys, values = _stored(cache)
    _check_against_float64(chunks, q, out, keys, values)
    # What the cache holds is the new keys rounded once: the first chunk's token (position 25) sits
    # in slot 1 of block 20.
    g = torch.Generator().manual_seed(0)
    cached = torch.randn(cache.arena.shape, generator=g)
    if kv_dtype == FP8:
        torch.randint(-8, 9, cached.shape[:-1], generator=g)
    torch.randn(1, q.shape[1], HQ, D, generator=g)
    k_new = torch.randn(1, q.shape[1], HKV, D, generator=g)
    rounded = dequantize_fp8(*quantize_fp8(k_new[0, 0])) if kv_dtype == FP8 else k_new[0, 0].to(kv_dtype)
    assert torch.equal(keys[20, 1], rounded.double())
    assert torch.equal(cache.stored(k_new[0, 0]), rounded.float())


def _two_ranks(rank, world_size, paths):
    for kv_dtype, path in paths:
        backend = attention_backend("ring") if path == "ring" else attention_backend("tree", method="allreduce")
        with pytest.MonkeyPatch.context() as monkeypatch:  # ring: the gathered shards pass around the ring (ring_decode)
            chunks, q, out, cache = _step(kv_dtype, "gather" if path == "ring" else path, monkeypatch, rank=rank,
                                          combine=None if path == "ring" else (None, "allreduce", 1), owner=lambda b: b % 2,
                                          backend=backend)
        mine = torch.stack(_stored(cache)).float()  # (2, blocks, BS, Hkv, D): this rank's blocks are those b % 2 == rank
        every = [torch.empty_like(mine) for _ in range(world_size)]
        dist.all_gather(every, mine)
        stored = torch.stack([every[b % 2][:, b] for b in range(mine.shape[1])], dim=1).double()  # block b from its rank
        _check_against_float64(chunks, q, out, stored[0], stored[1])
    return True


def test_two_ranks_match_float64_on_the_stored_cache():
    """Each rank stores its blocks (b % 2) in bfloat16 or fp8 and reads them by the paged kernel (or
    the gathered path without numba), the shared-prefix reads, or gathers; the states combine across
    real gloo ranks (tree_decode's combine; the prefill chunk by tree_decode; or ring_decode passing
    the dequantized shards) into float64 attention over every rank's stored blocks."""
    paths = [(torch.bfloat16, "kernel"), (FP8, "kernel")] if KERNEL else []
    paths += [(torch.bfloat16, "shared"), (FP8, "shared"), (torch.bfloat16, "gather"), (FP8, "runs"), (FP8, "ring")]
    assert ta.spawn(_two_ranks, 2, paths) == [True, True]


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


def test_engine_fp8_cache_kernel_and_torch_reads_give_one_answer(monkeypatch):
    """The fp8 cache read by the paged kernel (scales folded into scores and weights) and by the
    gathered / run-by-run reads (dequantized copies): the same greedy tokens. (Two ranks, ring
    decoding and shared prefixes over fp8: test_two_ranks_match_float64_on_the_stored_cache; static
    steps read through gather(); the float32 comparison is bfloat16's test's. Kept to one process:
    an engine of two ranks costs ~10 s here.)"""
    model = random_model(CONFIG, seed=3)
    fp8, measured = _tokens(model, kv_cache_dtype="fp8_e4m3")
    assert measured[0].kv_bytes % (CONFIG.num_layers * 2 * CONFIG.num_kv_heads * (CONFIG.head_dim + 4)) == 0
    monkeypatch.setattr(engine_batch, "kernel_takes", lambda *args: False)
    assert _tokens(model, kv_cache_dtype="fp8_e4m3")[0] == fp8


def test_kv_cache_dtype_is_checked_and_resolved():
    assert resolve_kv_cache_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert resolve_kv_cache_dtype("float16", torch.float32) == torch.float16
    with pytest.raises(ConfigError, match="kv_cache_dtype must be one of"):
        EngineConfig(kv_cache_dtype="fp8")
    assert resolve_kv_cache_dtype("fp8_e4m3", torch.bfloat16) == FP8


# ---------------------------------------------------------------- a hybrid model's window layers

def _held(x, kv_dtype):
    """x as a cache of kv_dtype holds it, widened to float32."""
    return dequantize_fp8(*quantize_fp8(x)) if kv_dtype == FP8 else x.to(kv_dtype).float()


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, FP8], ids=["bfloat16", "fp8"])
def test_window_layers_hold_what_the_cache_dtype_stores(kv_dtype):
    """A window ring stored in kv_dtype returns, in float32, exactly what a float32 ring returns when
    fed the stored values (prompt chunks, decode steps past the window, a rollback); a checkpoint
    restores the same bits (no second rounding); its bytes count fp8's scales."""
    from treeattn.cache.window import WindowKVCache, window_bytes_per_sequence

    g = torch.Generator().manual_seed(0)
    ours = WindowKVCache({0: 8}, num_kv_heads=2, head_dim=16, dtype=kv_dtype, compute_dtype=torch.float32)
    reference = WindowKVCache({0: 8}, num_kv_heads=2, head_dim=16, dtype=torch.float32)
    steps = [(0, 20), (20, 1), (21, 3), (22, 1), (23, 30), (53, 1)]  # (start, n): chunks, decodes, a rollback to 22
    for start, n in steps:
        k = torch.randn(n, 2, 16, generator=g) * torch.exp2(torch.randint(-6, 7, (n, 2, 1), generator=g))
        v = torch.randn(n, 2, 16, generator=g)
        got, want = ours.extend(0, 7, start, k, v), reference.extend(0, 7, start, _held(k, kv_dtype), _held(v, kv_dtype))
        assert all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(got, want)), (start, n)
    ours.save(7, 54, checkpoint=1)
    reference.save(7, 54, checkpoint=1)
    ours.restore(8, 1)
    reference.restore(8, 1)
    k, v = torch.randn(1, 2, 16, generator=g), torch.randn(1, 2, 16, generator=g)
    got, want = ours.extend(0, 8, 54, k, v), reference.extend(0, 8, 54, _held(k, kv_dtype), _held(v, kv_dtype))
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    itemsize = 1 if kv_dtype == FP8 else 2
    per_row = 2 * 2 * (16 * itemsize + (4 if kv_dtype == FP8 else 0))
    config = LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2, num_kv_heads=2,
                         head_dim=16, max_position_embeddings=128, layer_windows=(8, None))
    assert window_bytes_per_sequence(config, kv_dtype) == (8 - 1 + 16) * per_row
    held = 2 * 2 * 16 * 4 if kv_dtype == torch.bfloat16 else per_row  # a 16-bit ring read in float32 is held in float32
    assert window_bytes_per_sequence(config, kv_dtype, torch.float32) == (8 - 1 + 16) * held
    assert ours.nbytes() == 2 * (8 - 1 + 16) * held + 7 * per_row  # two rings and one checkpoint of 7 rows (stored dtype)


HYBRID = LlamaConfig(vocab_size=97, hidden_size=48, intermediate_size=64, num_layers=2, num_heads=6, num_kv_heads=2,
                     head_dim=8, max_position_embeddings=512, layer_windows=(16, None))


@pytest.mark.parametrize("kv_dtype", ["bfloat16", "fp8_e4m3"])
def test_engine_hybrid_model_runs_a_16_and_8_bit_cache(kv_dtype, monkeypatch):
    """A window layer beside a global one: the kernel and the torch reads of the global layer give
    one set of greedy tokens, and a follow-up request that starts from a window checkpoint of the
    prefix cache gives the tokens of the same request without the prefix cache."""
    model = random_model(HYBRID, seed=5)
    tokens, measured = _tokens(model, kv_cache_dtype=kv_dtype)
    assert measured[0].kv_bytes < _tokens(model, kv_cache_dtype="float32")[1][0].kv_bytes
    follow = PROMPTS[3] + tokens[3] + list(range(40, 60))
    options = {"nproc": 1, "decode": "tree", "max_batch_size": 4, "block_size": 8, "kv_cache_dtype": kv_dtype}
    with ta.Engine(model, **options) as engine:
        engine.generate(PROMPTS[3], max_new_tokens=6)
        cached = engine.generate(follow, max_new_tokens=6)[0]
    with ta.Engine(model, prefix_cache=False, **options) as engine:
        alone = engine.generate(follow, max_new_tokens=6)[0]
    assert cached.cached_prompt_tokens > 0 and cached.token_ids == alone.token_ids
    monkeypatch.setattr(engine_batch, "kernel_takes", lambda *args: False)
    assert _tokens(model, kv_cache_dtype=kv_dtype)[0] == tokens


# ---------------------------------------------------------------- fp8: the quantization itself


def test_fp8_rows_have_power_of_two_scales_and_e4m3_rounding():
    """Each row (token, KV head) gets scale 2**(e - 8), max|row| = m 2**e: codes stay below 256 (e4m3's
    max is 448), the dequantization codes * scale is exact (checked in float64), and every entry of
    at least max|row| * 2**-13 (a normal e4m3 code) is within 2**-4 relative of the input; rows of
    zeros, of huge and of tiny magnitudes included."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 3, 32, generator=g) * torch.exp2(torch.randint(-140, 120, (64, 3, 1), generator=g).float())
    x[0, 0] = 0.0
    codes, scales = quantize_fp8(x.bfloat16())  # any float dtype in
    assert codes.dtype == FP8 and scales.dtype == torch.float32 and scales.shape == (64, 3)
    mantissa, exponent = torch.frexp(scales)
    assert torch.all(mantissa == 0.5) and torch.all(exponent >= -125)  # powers of two, 2**-126 at least
    assert torch.all(codes.float().abs() <= 256)
    back = dequantize_fp8(codes, scales)
    assert torch.equal(back.double(), codes.double() * scales.double()[..., None])
    xb = x.bfloat16().double()
    big = xb.abs() >= xb.abs().amax(-1, keepdim=True) * 2.0**-13
    assert torch.all(((back.double() - xb).abs() <= 2.0**-4 * xb.abs())[big])
    assert torch.equal(back[0, 0], torch.zeros(32))
    assert dequantize_fp8(*quantize_fp8(x), torch.bfloat16).dtype == torch.bfloat16


def test_fp8_keeps_non_finite_values_non_finite():
    """torch's float8_e4m3fn conversion saturates inf to 448; the cache must not turn a non-finite key into a finite one."""
    x = torch.ones(4, 8)
    x[0, 3], x[1, 0], x[2, 5] = float("inf"), float("-inf"), float("nan")
    back = dequantize_fp8(*quantize_fp8(x))
    assert torch.isnan(back[:3]).any(dim=-1).all() and torch.equal(back[3], torch.ones(8))
    assert torch.isnan(back[0, 3]) and torch.isnan(back[1, 0]) and torch.isnan(back[2, 5])


def test_fp8_bad_input_names_the_argument():
    with pytest.raises(TypeError, match="x must be a floating tensor"):
        quantize_fp8(torch.ones(3, dtype=torch.int64))
    with pytest.raises(TypeError, match="codes must be float8_e4m3fn"):
        dequantize_fp8(torch.ones(2, 4), torch.ones(2))
    with pytest.raises(TypeError, match="dtype must be a floating torch.dtype"):
        PagedKVCache(num_layers=1, num_kv_heads=1, head_dim=4, num_blocks=2, block_size=2, dtype=torch.float8_e5m2)
    with pytest.raises(TypeError, match="compute_dtype must be a dtype attention computes in"):
        PagedKVCache(num_layers=1, num_kv_heads=1, head_dim=4, num_blocks=2, block_size=2, dtype=FP8, compute_dtype=FP8)


def test_fp8_cache_bytes_count_the_scales():
    """An fp8 arena holds D bytes of codes and 4 of scale per token, head and k/v plane; kv_bytes_per_token
    and the memory check's per-rank bytes say as much."""
    from treeattn.cache.sharded import kv_bytes_per_token

    c = CONFIG
    cache = PagedKVCache(num_layers=c.num_layers, num_kv_heads=c.num_kv_heads, head_dim=c.head_dim, num_blocks=3, block_size=BS,
                         dtype=FP8)
    per_token = c.num_layers * 2 * c.num_kv_heads * (c.head_dim + 4)
    assert cache.nbytes() == (3 + 1) * BS * kv_bytes_per_token(c, FP8) == (3 + 1) * BS * per_token
    assert kv_bytes_per_token(c, FP8) * 4 * c.head_dim == kv_bytes_per_token(c, torch.float32) * (c.head_dim + 4)
    # the memory check sizes a rank's fp8 arena with its scales too
    from treeattn.engine.memory import kv_cache_bytes_per_rank

    config = EngineConfig(block_size=BS)
    assert kv_cache_bytes_per_rank(config, c, FP8) == (config.blocks_per_rank(c.max_position_embeddings) + 1) * BS * per_token
