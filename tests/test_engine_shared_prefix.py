"""Shared-prefix decode attention in the engine (treeattn.engine.worker.shared_prefix): decoding sequences
that share blocks read them once per step, with the same tokens as reading them per sequence and
as each request alone.

The workload: two documents cached first, then questions over them submitted together, so that
one step decodes sequences sharing different prefixes (document A, document B, and document A
plus a shared instruction: nested sharing) next to a sequence that shares nothing. Checked on
p = 1, 2, 3 (one spawn of 3 ranks, engines on sub-groups), both placements, run-by-run reads and
gathers, prompt-lookup drafts, greedy against the uncached oracle and sampled against the same
engine without sharing; the engine's shared_prefix_keys counter shows that sharing happened (and
that ring decoding, where it does not apply, reads as before).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import treeattn as ta
from helpers.token_parallel import CONFIG, _uncached_greedy
from treeattn.cache.blocks import BlockRef
from treeattn.cache.paged import PagedKVCache
from treeattn.engine.worker import batch as engine_batch, shared_prefix
from treeattn.engine import SamplingParams
from treeattn.engine.scheduler import Chunk, StepPlan
from treeattn.models.attention import LocalAttention
from treeattn.models.llama import random_model
from treeattn.parallel import spawn

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one torch thread (conftest.py)

BLOCK = 4
OPTIONS = dict(block_size=BLOCK, cache_tokens=1024, prefill_chunk=16, max_batch_size=8, timeout_s=60)
CASES = [  # (p, engine options, read own shards run by run)
    (1, dict(decode="local", placement="contiguous"), False),
    (2, dict(decode="tree", placement="contiguous"), True),
    (2, dict(decode="tree", placement="interleaved", speculate="ngram"), False),
    (2, dict(decode="ring", placement="interleaved"), False),
    (3, dict(decode="tree", method="tree", placement="interleaved"), True),
    (3, dict(decode="tree", placement="contiguous", speculate="ngram"), False),
]
SAMPLED = SamplingParams(max_new_tokens=6, temperature=1.0, top_k=20, seed=13)


def _workload() -> tuple[list[list[int]], list[tuple[list[int], int]]]:
    """Two documents (40 and 24 tokens) and 7 questions: 3 over A (one repeats a piece of A, for
    prompt lookup), 2 over A + a 16-token instruction, 1 over B, 1 over nothing cached."""
    g = torch.Generator().manual_seed(11)
    rand = lambda n: torch.randint(0, 128, (n,), generator=g).tolist()  # noqa: E731
    doc_a, doc_b, instruction = rand(40), rand(24), rand(16)
    questions = [doc_a + rand(3), doc_a + rand(6), doc_a + doc_a[8:20], doc_a + instruction + rand(2),
                 doc_a + instruction + rand(5), doc_b + rand(4), rand(9)]
    return [doc_a, doc_b, doc_a + instruction], [(q, 4 + i % 4) for i, q in enumerate(questions)]


DOCS, QUESTIONS = _workload()


def _run(engine, params=None) -> list[list[int]]:
    engine.generate(DOCS, max_new_tokens=1)  # the documents' blocks enter the prefix cache
    handles = [engine.submit(q, params or SamplingParams(max_new_tokens=n)) for q, n in QUESTIONS]
    return [h.result(timeout=60).token_ids for h in handles]


def _cases(rank: int, world_size: int) -> list[dict]:
    torch.set_num_threads(1)
    model = random_model(CONFIG, seed=3, std=0.15)
    groups = {1: dist.new_group([0]), 2: dist.new_group([0, 1]), 3: None}
    out = []
    for p, options, copy_free in CASES:
        if rank >= p:
            continue
        engine_batch.COPY_FREE_MIN_KEYS = 0 if copy_free else 1 << 40
        run = dict(p=p, options=options)
        for sharing in (True, False):
            shared_prefix.SHARE_MIN_SAVED_KEYS = 8 if sharing else 1 << 40
            with ta.Engine(model, group=groups[p], **OPTIONS, **options) as engine:
                if engine.is_driver:
                    run[sharing] = dict(greedy=_run(engine), stats=engine.stats())
                    engine.clear_prefix_cache()
                    run[sharing]["sampled"] = _run(engine, SAMPLED)
        if rank == 0:
            out.append(run)
    return out


@pytest.fixture(scope="module")
def runs():
    return spawn(_cases, 3, timeout=300)[0]


@pytest.fixture(scope="module")
def oracle():
    model = random_model(CONFIG, seed=3, std=0.15)
    return [_uncached_greedy(model, q, n) for q, n in QUESTIONS]


def _case_id(case):
    p, options, copy_free = case
    return f"p{p}-{options['decode']}-{options['placement']}-{'runs' if copy_free else 'gather'}" + (
        "-ngram" if "speculate" in options else "")


def test_every_case_ran(runs):
    assert [(r["p"], r["options"]) for r in runs] == [(p, o) for p, o, _ in CASES]


@pytest.mark.parametrize("case", range(len(CASES)), ids=[_case_id(c) for c in CASES])
def test_sharing_gives_the_tokens_of_each_request_alone(runs, oracle, case):
    run = runs[case]
    assert run[True]["greedy"] == run[False]["greedy"] == oracle
    assert run[True]["sampled"] == run[False]["sampled"]
    assert run[False]["stats"]["shared_prefix_keys"] == 0
    if run["options"]["decode"] == "ring" and run["p"] > 1:  # ring_decode passes the shards: no sharing
        assert run[True]["stats"]["shared_prefix_keys"] == 0
    else:  # at least the three questions over A shared its 10 blocks in their first step
        assert run[True]["stats"]["shared_prefix_keys"] >= 2 * 40
    if "speculate" in run["options"]:
        assert run[True]["stats"]["drafted_tokens"] > 0


def _chunk(blocks: list[int], start: int, drafts: int = 0) -> Chunk:
    return Chunk(0, (1,) * (1 + drafts), start, tuple(BlockRef(b % 2, b) for b in blocks), None, drafts)


def test_segments_cover_shared_prefixes_nested_and_apart():
    chunks = [
        _chunk([0, 1, 2, 3, 10], 17),          # document 0-3, own block 10
        _chunk([0, 1, 2, 3, 4, 5, 11], 25),    # document, instruction 4-5, own 11
        _chunk([0, 1, 2, 3, 4, 5, 12], 24, 2),  # the same, with 2 drafts
        _chunk([20, 21, 22], 9),               # document 20-21 (+ its current block 22)
        _chunk([20, 21, 23], 10),
        _chunk([0, 30], 5),                    # shares block 0 only
    ]
    segments, own_from = shared_prefix.find_segments(chunks, block_size=4, min_saved=8)
    assert [(s.members, s.lo, s.hi) for s in segments] == [((0, 1, 2, 5), 0, 1), ((0, 1, 2), 1, 4), ((1, 2), 4, 6),
                                                           ((3, 4), 0, 2)]
    assert [s.blocks for s in segments] == [chunks[0].blocks[:1], chunks[0].blocks[1:4], chunks[1].blocks[4:6],
                                            chunks[3].blocks[:2]]
    assert own_from == [4, 6, 6, 2, 2, 1]
    assert shared_prefix.saved_keys(segments, 4) == 3 * 4 + 2 * 12 + 8 + 8
    # Stretches saving fewer than 20 key reads pass down into the segment below them, or stay
    # with each sequence's own blocks.
    segments, own_from = shared_prefix.find_segments(chunks, block_size=4, min_saved=20)
    assert [(s.members, s.lo, s.hi) for s in segments] == [((0, 1, 2), 0, 4)]
    assert own_from == [4, 4, 4, 0, 0, 0]


@pytest.mark.parametrize("prefill_chunk", [16, 64])
def test_questions_over_one_uncached_document_submitted_together_prefill_it_once(oracle, prefill_chunk):
    """4 questions over document A (40 tokens, 10 blocks), none of it cached: the first prefills A,
    the others wait for its blocks and prefill only their own tokens."""
    with ta.Engine(random_model(CONFIG, seed=3, std=0.15), nproc=1, decode="local", block_size=BLOCK, cache_tokens=512,
                   prefill_chunk=prefill_chunk, max_batch_size=8) as engine:
        results = engine.generate([q for q, _ in QUESTIONS[:4]], max_new_tokens=4)
    assert [r.cached_prompt_tokens for r in results] == [0, len(DOCS[0]), len(DOCS[0]), len(DOCS[0])]
    assert [r.token_ids for r in results] == [o[:4] for o in oracle[:4]]


@pytest.mark.parametrize("prefill_chunk", [16, 64])
def test_one_prompt_submitted_n_times_together_is_prefilled_once(oracle, prefill_chunk):
    """4 requests with one prompt: the first prefills it, the other 3 wait for its full blocks and
    find them all in the prefix cache (each computes only the last, partial block); tokens unchanged.
    (prefill_chunk 64: all 4 fit in the first step's budget; 16: the first prefills over 3 steps.)"""
    prompt, n = QUESTIONS[1]
    full = (len(prompt) - 1) // BLOCK * BLOCK
    with ta.Engine(random_model(CONFIG, seed=3, std=0.15), nproc=1, decode="local", block_size=BLOCK, cache_tokens=512,
                   prefill_chunk=prefill_chunk, max_batch_size=8) as engine:
        results = engine.generate([prompt] * 4, max_new_tokens=n)
        assert [r.cached_prompt_tokens for r in results] == [0, full, full, full]
        assert engine.stats()["prefix_hit_tokens"] == 3 * full
    assert [r.token_ids for r in results] == [oracle[1]] * 4


@pytest.mark.parametrize("value_dim", [None, 8], ids=["kv", "latent"])
@pytest.mark.parametrize("copy_free", [False, True], ids=["gather", "runs"])
def test_one_layer_with_shared_segments_matches_float64_attention_per_sequence(monkeypatch, value_dim, copy_free):
    """PagedBatch's decode attention with segments (nested: a document for 3 sequences, an
    instruction after it for 2; one sequence with 2 drafts; one sharing nothing) equals plain
    attention over each sequence's own keys, in float64, for a latent cache (values = the keys'
    first value_dim channels) too."""
    bs, hkv, hq, d = 4, 2, 4, 16
    g = torch.Generator().manual_seed(0)
    cache = PagedKVCache(num_layers=1, num_kv_heads=hkv, head_dim=d, value_dim=value_dim, num_blocks=40, block_size=bs,
                         dtype=torch.float64)
    cache.arena.normal_(generator=g)
    doc, instruction = list(range(6)), [6, 7]
    refs = lambda ids: tuple(BlockRef(0, i) for i in ids)  # noqa: E731
    chunks = (Chunk(0, (1,), 25, refs(doc + [20]), None), Chunk(1, (1, 2, 3), 34, refs(doc + instruction + [21, 23]), None, 2),
              Chunk(2, (1,), 32, refs(doc + instruction + [22]), None), Chunk(3, (1, 1), 9, refs([30, 31, 32]), None, 1))
    T, dv = sum(len(c.tokens) for c in chunks), value_dim or d
    q = torch.randn(1, T, hq, d, generator=g, dtype=torch.float64)
    k_new, v_new = torch.randn(1, T, hkv, d, generator=g, dtype=torch.float64), torch.randn(1, T, hkv, dv, generator=g,
                                                                                            dtype=torch.float64)
    monkeypatch.setattr(engine_batch, "COPY_FREE_MIN_KEYS", 0 if copy_free else 1 << 40)
    monkeypatch.setattr(shared_prefix, "SHARE_MIN_SAVED_KEYS", 1)
    arena = cache.arena.clone()
    batch = engine_batch.PagedBatch(StepPlan(chunks), 0, cache, LocalAttention(), combine=(None, "allreduce", 1))
    k, v, pos = batch.kv_store(0, k_new, v_new)
    out = batch.attend(q, k, v, q_pos=None, kv_pos=pos, window=None)[0]
    assert batch.shared_keys == 2 * 24 + 8 and batch.groups[0].shared is not None
    keys, values = cache.blocks(0)
    row = 0
    for c in chunks:
        n, end = len(c.tokens), c.start + len(c.tokens)
        ids = torch.tensor([ref.index for ref in c.blocks])
        k_seq, v_seq = keys[ids].flatten(0, 1)[None, :end], values[ids].flatten(0, 1)[None, :end]
        expected, _ = ta.attention(q[:, row : row + n], k_seq, v_seq, causal=True, q_pos=torch.arange(c.start, end),
                                   kv_pos=torch.arange(end))
        torch.testing.assert_close(out[row : row + n], expected[0], rtol=1e-12, atol=1e-12)
        row += n
    # the same step without sharing reads as before and gives the same output
    cache.arena.copy_(arena)
    monkeypatch.setattr(shared_prefix, "SHARE_MIN_SAVED_KEYS", 1 << 40)
    batch = engine_batch.PagedBatch(StepPlan(chunks), 0, cache, LocalAttention(), combine=(None, "allreduce", 1))
    k, v, pos = batch.kv_store(0, k_new, v_new)
    assert batch.shared_keys == 0 and batch.groups[0].shared is None
    torch.testing.assert_close(batch.attend(q, k, v, q_pos=None, kv_pos=pos, window=None)[0], out, rtol=1e-12, atol=1e-12)
