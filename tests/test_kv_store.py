"""The prefix cache's second tier (treeattn.cache.store, treeattn.engine.kv_tier).

The store alone: blocks round-trip under hex names; corrupt, truncated and foreign files are
skipped with a warning and removed, never returned; the size bound evicts least recently used
first; two processes writing the same and different blocks at once leave only whole files; a
block's payload is its arena bytes (disk bytes per token == arena bytes per token for float32,
bfloat16 and fp8). The engine: a new Engine on the same directory (a restart) finds the prompt's
blocks on disk and gives the fresh prefill's greedy tokens, on 1 and 2 gloo ranks with float32 and
bfloat16 KV, and a 2-rank store read by 1 rank (re-sharded by reading); a hybrid model's window
checkpoints are stored and restored with its blocks; DeepSeek's latent cache; another model or KV dtype
never matches; a corrupt block is skipped and recomputed; nothing is written outside the directory;
the refusals are one line.
"""

from __future__ import annotations

import logging
import multiprocessing
import os

import pytest
import torch

import treeattn as ta
from treeattn.cache.paged import PagedKVCache
from treeattn.cache.store import HEADER, ROOT, KVStore, block_digest, chain_digests, namespace
from treeattn.engine.config import EngineConfig
from treeattn.engine.errors import ConfigError
from treeattn.engine.kv_tier import RankKVStore
from treeattn.models.llama import LlamaConfig, random_model

CONFIG = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=16,
              max_position_embeddings=512)
PROMPT = [(i * 7 + 3) % 64 for i in range(100)]  # 6 full blocks of 16, and 4 tokens
BLOCK = 16


def model(seed: int = 0, **changes):
    return random_model(LlamaConfig(**{**CONFIG, **changes}), seed=seed)


def engine(m, store, nproc=1, **options):
    return ta.Engine(m, nproc=nproc, block_size=BLOCK, cache_tokens=512, kv_store=None if store is None else str(store),
                     placement="interleaved", timeout_s=60, **options)


def files_under(path) -> list[str]:
    return sorted(os.path.relpath(os.path.join(d, f), path) for d, _, names in os.walk(path) for f in names)


# ---------------------------------------------------------------------------------------------- the store alone


def test_blocks_round_trip_under_hex_names(tmp_path):
    store = KVStore(tmp_path, namespace("m"))
    keys = chain_digests(PROMPT, BLOCK, 3)
    assert keys[0] == block_digest(ROOT, PROMPT[:BLOCK]) and len(set(keys)) == 3
    for i, key in enumerate(keys):
        assert store.put(key, bytes([i]) * 100) == HEADER.size + 100
        assert store.put(key, bytes([i]) * 100) == 0  # there already
    assert [bytes(store.get(k)) for k in keys] == [bytes([i]) * 100 for i in range(3)]
    assert files_under(tmp_path) == sorted(os.path.join(store.namespace, k.hex() + ".kvb") for k in keys)
    with pytest.raises(ValueError, match="key must be 16 bytes"):
        store.path(b"../etc")
    assert os.path.dirname(store.path(b"../../etc/passwd")) == store.dir  # 16 bytes: named by their hex
    with pytest.raises(ValueError, match="namespace must be 32 lowercase hex digits"):
        KVStore(tmp_path, "../elsewhere")


@pytest.mark.parametrize("damage", ["flip", "truncate", "header", "foreign"])
def test_corrupt_files_are_skipped_with_a_warning_and_removed(tmp_path, caplog, damage):
    store = KVStore(tmp_path, namespace("m"))
    key, other = chain_digests(PROMPT, BLOCK, 2)
    store.put(key, os.urandom(1000))
    path = store.path(key)
    data = bytearray(open(path, "rb").read())
    if damage == "flip":
        data[-1] ^= 1
    elif damage == "truncate":
        del data[-10:]
    elif damage == "header":
        data = data[:20]
    else:  # another block's file under this name
        store.put(other, os.urandom(1000))
        data = bytearray(open(store.path(other), "rb").read())
    open(path, "wb").write(data)
    with caplog.at_level(logging.WARNING, logger="treeattn.cache.store"):
        assert store.get(key) is None
    assert "KV store: skipping" in caplog.text and not os.path.exists(path)


def test_size_bound_evicts_least_recently_used(tmp_path):
    size = HEADER.size + 1000
    store = KVStore(tmp_path, namespace("m"), max_bytes=3 * size)
    keys = chain_digests(list(range(6 * BLOCK)), BLOCK, 6)
    for i, key in enumerate(keys[:3]):
        store.put(key, bytes(1000))
        os.utime(store.path(key), (1000 + i, 1000 + i))  # written in order 0, 1, 2
    store.get(keys[0])  # 0 used now: 1 is the least recently used
    store.put(keys[3], bytes(1000))
    assert store.evict() == 3 * size
    assert [k in store for k in keys[:4]] == [True, False, True, True]
    assert store.put(keys[4], bytes(4 * size)) == 0  # alone over the bound: not stored
    assert store.total_bytes() <= 3 * size


def _writer(root: str, ns: str, seed: int, rounds: int) -> None:
    store = KVStore(root, ns, max_bytes=40 * (HEADER.size + 4096))
    keys = chain_digests(list(range(64 * BLOCK)), BLOCK, 64)
    for r in range(rounds):
        for i, key in enumerate(keys):
            if (i + seed + r) % 2 == 0:  # both write the even keys of one round and the odd of the next
                store.put(key, bytes([i]) * 4096)
        store.evict()


def test_concurrent_writers_leave_only_whole_files(tmp_path):
    ns = namespace("m")
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_writer, args=(str(tmp_path), ns, seed, 4)) for seed in (0, 1)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    store = KVStore(tmp_path, ns)
    keys = chain_digests(list(range(64 * BLOCK)), BLOCK, 64)
    present = [i for i, k in enumerate(keys) if k in store]
    assert present and all(bytes(store.get(keys[i])) == bytes([i]) * 4096 for i in present)
    assert not [f for f in files_under(tmp_path) if ".tmp-" in f]
    assert store.total_bytes() <= 40 * (HEADER.size + 4096)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_disk_bytes_per_token_equal_arena_bytes_per_token(tmp_path, dtype):
    m = model()
    cache = PagedKVCache(num_layers=2, num_kv_heads=1, head_dim=16, num_blocks=4, block_size=BLOCK, dtype=dtype)
    cache.write(0, torch.arange(2 * BLOCK), torch.randn(2 * BLOCK, 1, 16), torch.randn(2 * BLOCK, 1, 16))
    cache.write(1, torch.arange(2 * BLOCK), torch.randn(2 * BLOCK, 1, 16), torch.randn(2 * BLOCK, 1, 16))
    rank = RankKVStore(cache, m, str(tmp_path), None)
    arena_per_token = cache.nbytes() / ((cache.num_blocks + 1) * BLOCK)
    assert (
        rank.bytes_per_block / BLOCK == arena_per_token == 2 * 2 * 16 * dtype.itemsize + (2 * 2 * 4 if dtype.itemsize == 1 else 0)
    )
    key = chain_digests(PROMPT, BLOCK, 1)[0]
    written = rank.store.put(key, rank.block_bytes(1))
    assert written - HEADER.size == rank.bytes_per_block == os.path.getsize(rank.store.path(key)) - HEADER.size
    rank.load_block(3, rank.store.get(key))
    assert torch.equal(cache.arena[:, :, 3].view(torch.uint8), cache.arena[:, :, 1].view(torch.uint8))
    if cache.scales is not None:
        assert torch.equal(cache.scales[:, :, 3], cache.scales[:, :, 1])
    other = RankKVStore(PagedKVCache(num_layers=2, num_kv_heads=1, head_dim=16, num_blocks=4, block_size=BLOCK,
                                     dtype=torch.float16 if dtype != torch.float16 else torch.float32), m, str(tmp_path), None)
    assert other.namespace != rank.namespace


# ---------------------------------------------------------------------------------------------- the engine


def _run(m, store, nproc=1, **options):
    with engine(m, store, nproc, **options) as e:
        result = e.generate(PROMPT, max_new_tokens=6)[0]
        return result, e.stats()


@pytest.mark.parametrize("kv", ["float32", "bfloat16"])
@pytest.mark.parametrize("nproc", [1, 2])
def test_a_restart_gives_the_fresh_prefills_tokens(tmp_path, nproc, kv):
    """Engine 1 prefills with an empty store (a fresh prefill) and writes its blocks; engine 2 (a
    restart on the same directory) loads them and gives the same greedy tokens; on 2 ranks, a
    1-rank engine reads the 2-rank store too."""
    m, store = model(), tmp_path / "store"
    fresh, s1 = _run(m, store, nproc, kv_cache_dtype=kv)
    assert fresh.cached_prompt_tokens == 0 and s1["store_saved_blocks"] == 6 and s1["store_miss_blocks"] == 6
    runs = [(nproc, *_run(m, store, nproc, kv_cache_dtype=kv))]
    if nproc == 2:
        runs.append((1, *_run(m, store, 1, kv_cache_dtype=kv)))
    for p, restored, s2 in runs:
        assert restored.token_ids == fresh.token_ids, f"{p} rank(s)"
        assert restored.cached_prompt_tokens == 6 * BLOCK and s2["store_hit_blocks"] == 6 and s2["store_miss_blocks"] == 0
        assert s2["arena_miss_blocks"] == 6 and s2["store_loaded_bytes"] > 0 and s2["store_failed_blocks"] == 0
    assert os.listdir(tmp_path) == ["store"]  # nothing outside the store's directory
    assert all(f == ".lock" or f.endswith(".kvb") for f in (os.path.basename(x) for x in files_under(store)))


def test_another_model_or_kv_dtype_never_matches(tmp_path):
    store = tmp_path / "store"
    _run(model(0), store)
    for m, kv in ((model(1), "auto"), (model(0), "bfloat16"), (model(0, rope_theta=500.0), "auto")):
        result, stats = _run(m, store, kv_cache_dtype=kv)
        assert result.cached_prompt_tokens == 0 and stats["store_hit_blocks"] == 0
    assert len(os.listdir(store)) == 1 + 4  # .lock and one namespace per model/dtype


def test_a_corrupt_block_is_skipped_and_recomputed(tmp_path, caplog):
    m, store = model(), tmp_path / "store"
    fresh, _ = _run(m, store)
    third = KVStore(store, next(d for d in os.listdir(store) if d != ".lock")).path(chain_digests(PROMPT, BLOCK, 3)[2])
    data = bytearray(open(third, "rb").read())
    data[HEADER.size + 5] ^= 0xFF
    open(third, "wb").write(data)
    with caplog.at_level(logging.WARNING, logger="treeattn.cache.store"):
        restored, stats = _run(m, store)
    assert "checksum mismatch" in caplog.text
    assert restored.token_ids == fresh.token_ids and restored.cached_prompt_tokens == 2 * BLOCK
    assert stats["store_hit_blocks"] == 2 and stats["store_failed_blocks"] == 1
    assert stats["store_saved_blocks"] == 1  # the recomputed block written again (those after it are whole)
    again, stats = _run(m, store)
    assert again.token_ids == fresh.token_ids and stats["store_hit_blocks"] == 6


def test_eviction_from_the_arena_then_a_store_hit(tmp_path):
    """A prompt evicted from a small arena by other prompts is loaded back from disk."""
    m, store = model(), tmp_path / "store"
    other = [[(i * 5 + k) % 64 for i in range(100)] for k in range(1, 5)]
    with ta.Engine(m, nproc=1, block_size=BLOCK, cache_tokens=128, kv_store=str(store), timeout_s=60) as e:
        first = e.generate(PROMPT, max_new_tokens=6)[0]
        for prompt in other:
            e.generate(prompt, max_new_tokens=6)
        again = e.generate(PROMPT, max_new_tokens=6)[0]
        stats = e.stats()
    assert again.token_ids == first.token_ids and again.cached_prompt_tokens == 6 * BLOCK
    assert stats["store_hit_blocks"] >= 6


def test_refusals_are_one_line(tmp_path):
    with pytest.raises(ConfigError, match="kv_store is the prefix cache's second tier: it needs prefix_cache=True"):
        EngineConfig(kv_store=str(tmp_path), prefix_cache=False)
    with pytest.raises(ConfigError, match="not with speculate='draft'"):
        EngineConfig(kv_store=str(tmp_path), speculate="draft", draft_model="x")
    with pytest.raises(ConfigError, match="kv_store_bytes must be an int >= 1"):
        EngineConfig(kv_store=str(tmp_path), kv_store_bytes=0)


@pytest.mark.parametrize("nproc, kv", [(1, "float32"), (2, "bfloat16"), (1, "fp8_e4m3")])
def test_a_hybrid_models_window_checkpoints_are_stored(tmp_path, nproc, kv):
    """Window and global layers (Gemma 3's kind): a restart loads the blocks and the window
    checkpoint at their end (every rank), and gives the fresh prefill's tokens."""
    m, store = model(num_layers=3, layer_windows=(8, None, 24)), tmp_path / "store"
    fresh, first = _run(m, store, nproc, kv_cache_dtype=kv)
    restored, second = _run(m, store, nproc, kv_cache_dtype=kv)
    assert first["store_saved_blocks"] == 6 and len(os.listdir(store)) == 3  # .lock, blocks, window checkpoints
    assert restored.cached_prompt_tokens == 6 * BLOCK and second["store_hit_blocks"] == 6 and second["store_failed_blocks"] == 0
    assert restored.token_ids == fresh.token_ids


def test_metrics_show_hits_and_misses_per_tier():
    from treeattn.serve.metrics import _store_metrics

    stats = {"arena_hit_blocks": 1, "arena_miss_blocks": 6, "store_hit_blocks": 5, "store_miss_blocks": 1,
             "store_failed_blocks": 0,
             "store_saved_bytes": 10, "store_loaded_bytes": 20, "store_load_s": 0.5, "store_save_s": 0.25}
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in _store_metrics(stats) for s in f.samples}
    assert samples[("treeattn_kv_tier_blocks_total", (("result", "hit"), ("tier", "disk")))] == 5
    assert samples[("treeattn_kv_tier_blocks_total", (("result", "miss"), ("tier", "arena")))] == 6
    assert samples[("treeattn_kv_store_bytes_total", (("direction", "read"),))] == 20
    assert samples[("treeattn_kv_store_seconds_total", (("op", "load"),))] == 0.5


def test_docstring_examples_of_the_store_modules_run():
    import doctest

    import treeattn.cache.store as store
    import treeattn.engine.kv_tier as kv_tier

    for module in (store, kv_tier):
        failures, tried = doctest.testmod(module)
        assert tried and not failures, module.__name__


def test_mla_latent_cache_restores(tmp_path):
    """DeepSeek-V3's latent cache (one plane per layer: the values inside the keys), loaded from a
    checkpoint directory on every start: a restart gives the fresh prefill's tokens."""
    pytest.importorskip("transformers")
    from helpers.deepseek_checkpoints import PROMPT as IDS, make_checkpoint

    make_checkpoint("v3", tmp_path / "v3")
    runs = []
    for _ in range(2):
        with ta.Engine(str(tmp_path / "v3"), nproc=1, block_size=4, cache_tokens=64, kv_store=str(tmp_path / "store")) as e:
            runs.append((e.generate(IDS, max_new_tokens=8, ignore_eos=True)[0], e.stats()))
    (fresh, first), (restored, second) = runs
    assert first["store_saved_blocks"] >= 3 and second["store_hit_blocks"] == 3 and restored.cached_prompt_tokens == 12
    assert restored.token_ids == fresh.token_ids


def test_two_live_engines_share_one_store(tmp_path):
    """Two engines open at once on one directory (two servers of one host): what one prefilled,
    the other loads."""
    m, store = model(), tmp_path / "store"
    with engine(m, store) as a, engine(m, store) as b:
        first = a.generate(PROMPT, max_new_tokens=6)[0]
        second = b.generate(PROMPT, max_new_tokens=6)[0]
        stats = b.stats()
    assert second.token_ids == first.token_ids and second.cached_prompt_tokens == 6 * BLOCK and stats["store_hit_blocks"] == 6


def test_a_store_that_cannot_be_written_is_refused_or_skipped(tmp_path, caplog):
    """A kv_store path that cannot be a directory: ConfigError before any rank starts; a store
    that fails under a running engine (here its namespace replaced by a file): warnings, and the
    request's tokens as without a store."""
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match="kv_store: cannot create the directory"):
        engine(model(), tmp_path / "file" / "store")
    m, store = model(), tmp_path / "store"
    fresh, _ = _run(m, None)
    with engine(m, store) as e:
        for sub in os.listdir(store):
            if sub != ".lock":
                os.rmdir(store / sub)
                (store / sub).write_text("not a directory")
        with caplog.at_level(logging.WARNING, logger="treeattn.engine.kv_tier"):
            result = e.generate(PROMPT, max_new_tokens=6)[0]
    assert result.token_ids == fresh.token_ids and "KV store: writing to" in caplog.text


def test_kv_store_is_refused_with_tensor_parallel_heads(tmp_path):
    """Blocks of the store hold every KV head; tensor-parallel ranks hold some: refused in one line."""
    from treeattn.engine.config import ConfigError, EngineConfig

    with pytest.raises(ConfigError, match="kv_store.*tp=2") as raised:
        EngineConfig(nproc=2, tp=2, kv_store=str(tmp_path))
    assert raised.value.option == "kv_store"
    EngineConfig(nproc=2, tp=1, kv_store=str(tmp_path))  # tp=1: every rank holds every head
