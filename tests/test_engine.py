"""ta.Engine: continuous batching and the prefix cache give each request exactly the tokens it gets
alone, on p = 1, 2, 3 ranks, tree and ring decoding, both placements, prefix cache on and off,
under cache pressure; prefix reuse; bad input; cancellation; a dead rank.

Half the configurations read each rank's shard run by run (attention per run of adjacent blocks,
merge_states, then combine_states across ranks), half gather it into one batch.

The oracle is ta.generate run on one prompt at a time in this process (its own cache and decode
loop, no engine code). The multi-rank configurations run in ONE spawn of 3 ranks: each
configuration builds an Engine inside a sub-group of 1, 2 or 3 ranks (the engine joins an existing
group; its group rank 0 drives, the others serve steps).
"""

from __future__ import annotations

import multiprocessing
import time

import pytest
import torch
import torch.distributed as dist
from helpers.letters import LetterTokenizer

import treeattn as ta
from treeattn.engine.worker import batch
from treeattn.engine import EngineError, SamplingParams
from treeattn.models.llama import LlamaConfig, random_model
from treeattn.parallel import spawn

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one torch thread (conftest.py)

CONFIG = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                     head_dim=16, max_position_embeddings=32768)
BLOCK = 4


def _model():
    return random_model(CONFIG, seed=3, std=0.15)


def _requests():
    """24 (prompt, max_new_tokens): 12 share a 40-token prefix (10 blocks) and differ after it."""
    g = torch.Generator().manual_seed(5)
    shared = torch.randint(0, 128, (40,), generator=g).tolist()
    out = []
    for i in range(24):
        tail = torch.randint(0, 128, (1 + i % 12,), generator=g).tolist()
        prompt = shared + tail if i % 2 == 0 else torch.randint(0, 128, (1 + (7 * i) % 29,), generator=g).tolist()
        out.append((prompt, 1 + i % 8))
    return out


REQUESTS = _requests()

# (p, engine options); every configuration also runs the 24 requests staggered.
PLENTY = dict(cache_tokens=2048, block_size=BLOCK, prefill_chunk=16, max_batch_size=8)
PRESSURE = dict(cache_tokens=64, block_size=BLOCK, prefill_chunk=16, max_batch_size=24)  # ~2 requests at once
CASES = [
    (1, dict(decode="local", placement="contiguous", prefix_cache=True, **PLENTY)),
    (1, dict(decode="local", placement="interleaved", prefix_cache=False, **PRESSURE)),
    (2, dict(decode="tree", placement="contiguous", prefix_cache=True, **PLENTY)),
    (2, dict(decode="tree", placement="interleaved", prefix_cache=False, **PLENTY)),
    (2, dict(decode="ring", placement="interleaved", prefix_cache=True, **PRESSURE)),
    (2, dict(decode="ring", placement="contiguous", prefix_cache=False, **PLENTY)),
    (3, dict(decode="tree", placement="interleaved", prefix_cache=False, **PLENTY)),
    (3, dict(decode="tree", method="tree", placement="contiguous", prefix_cache=True, **PRESSURE)),
    (3, dict(decode="ring", placement="contiguous", prefix_cache=True, **PLENTY)),
    (3, dict(decode="ring", placement="interleaved", prefix_cache=False, **PLENTY)),
]


def _run_together(engine) -> list[list[int]]:
    handles = [engine.submit(prompt, SamplingParams(max_new_tokens=n)) for prompt, n in REQUESTS]
    return [h.result(timeout=120).token_ids for h in handles]


def _run_staggered(engine) -> list[list[int]]:
    """A third of the requests, then more while the first decode, then the rest."""
    handles = [engine.submit(prompt, SamplingParams(max_new_tokens=n)) for prompt, n in REQUESTS[:8]]
    for event, _ in zip(handles[7], range(2)):  # the 8th request has produced tokens: the batch is busy
        pass
    handles += [engine.submit(prompt, SamplingParams(max_new_tokens=n)) for prompt, n in REQUESTS[8:16]]
    handles[9].result(timeout=120)
    handles += [engine.submit(prompt, SamplingParams(max_new_tokens=n)) for prompt, n in REQUESTS[16:]]
    return [h.result(timeout=120).token_ids for h in handles]


def _engine_cases(rank: int, world_size: int) -> list[dict]:
    torch.set_num_threads(1)
    model = _model()
    groups = {1: dist.new_group([0]), 2: dist.new_group([0, 1]), 3: None}
    out = []
    for case, (p, options) in enumerate(CASES):
        if rank >= p:
            continue
        # Half the cases read every shard run by run (no copy), half gather it (treeattn.engine.worker.runner).
        batch.COPY_FREE_MIN_KEYS = 0 if case % 2 else 1 << 40
        with ta.Engine(model, group=groups[p], timeout_s=60, **options) as engine:
            if not engine.is_driver:
                continue
            together = _run_together(engine)
            staggered = _run_staggered(engine)
            stats = engine.stats()
            engine.clear_prefix_cache()
            out.append(dict(p=p, options=options, together=together, staggered=staggered, stats=stats,
                            cleared=engine.stats()))
    return out


@pytest.fixture(scope="module")
def references():
    model = _model()
    refs = []
    for prompt, n in REQUESTS:
        with torch.no_grad():  # the oracle's own premise: no near-tie that rounding could flip
            logits = torch.stack([model.logits(model(torch.tensor([prompt]), torch.arange(len(prompt))[None],
                                                     *_uncached(len(prompt)))[0, -1])])
        top2 = logits.topk(2).values[0]
        assert top2[0] - top2[1] > 1e-4
        refs.append(ta.generate(model, prompt, max_new_tokens=n).generated_ids[0])
    return refs


def _uncached(length):
    """A kv_store/attend pair that attends over exactly this pass's keys (no cache)."""
    from treeattn.models.attention import LocalAttention

    def store(layer, k, v):
        return k, v, torch.arange(length)[None]

    return store, LocalAttention()


@pytest.fixture(scope="module")
def runs():
    return spawn(_engine_cases, 3, timeout=300)[0]


def test_every_configuration_ran(runs):
    assert [(r["p"], r["options"]) for r in runs] == CASES


@pytest.mark.parametrize("case", range(len(CASES)), ids=[f"p{p}-{o['decode']}-{o['placement']}-prefix{int(o['prefix_cache'])}"
                                                          f"-{'pressure' if o['cache_tokens'] < 100 else 'plenty'}" for p,
                                                         o in CASES])
def test_batched_greedy_tokens_equal_each_request_alone(runs, references, case):
    run = runs[case]
    assert run["together"] == references
    assert run["staggered"] == references


def test_prefix_cache_was_hit_and_pressure_preempted(runs):
    for run in runs:
        hits = run["stats"]["prefix_hit_tokens"]
        assert (hits >= 10 * BLOCK) == run["options"]["prefix_cache"]  # the 40-token shared prefix was reused
    pressure = [run for run in runs if run["options"]["cache_tokens"] == PRESSURE["cache_tokens"]]
    for run in pressure:  # far more requests than fit at once (they queued, or were preempted)
        assert sum(len(prompt) + n for prompt, n in REQUESTS) > 3 * run["stats"]["blocks_total"] * BLOCK
    assert sum(run["stats"]["preemptions"] for run in pressure) > 0
    for run in runs:
        assert run["stats"]["generated_tokens"] == 2 * sum(n for _, n in REQUESTS), run["options"]


def test_no_block_leaks_after_the_cache_is_cleared(runs):
    for run in runs:
        assert run["stats"]["running"] == run["stats"]["waiting"] == 0
        assert run["cleared"]["blocks_used"] == 0 and run["cleared"]["blocks_free"] == run["cleared"]["blocks_total"]
        assert run["cleared"]["blocks_cached"] == 0


# ------------------------------------------------------------------- one process: API and bad input


@pytest.fixture(scope="module")
def engine():
    with ta.Engine(_model(), nproc=1, cache_tokens=256, block_size=BLOCK, prefill_chunk=16, max_batch_size=4) as e:
        yield e


def test_a_prompt_that_can_never_fit_fails_alone(engine, references):
    prompt, n = REQUESTS[0]
    results = engine.generate([[1] * 300, prompt], max_new_tokens=n)
    assert results[0].finish_reason == "error" and "256" in results[0].error and "max_context" in results[0].error
    assert results[0].token_ids == []
    assert results[1].finish_reason == "length" and results[1].token_ids == references[0]


def test_max_context_limits_a_request_and_spans_contiguous_placement(references):
    """max_context=64 on a cache of 256 tokens: a request over 64 positions fails alone naming the option,
    and contiguous placement gives each of p = 1 ranks one span of 64 tokens."""
    prompt, n = REQUESTS[0]
    with ta.Engine(_model(), cache_tokens=256, block_size=BLOCK, max_context=64) as e:
        assert e.max_context == 64 and e.pool.span_blocks == 64 // BLOCK
        long, fits = e.generate([[1] * 64, prompt], max_new_tokens=n)
    assert long.finish_reason == "error" and "max_context is 64" in long.error
    assert fits.token_ids == references[0]
    with pytest.raises(ValueError, match="max_context=512 is more than the KV cache holds"):
        ta.Engine(_model(), cache_tokens=256, block_size=BLOCK, max_context=512)


@pytest.mark.parametrize("kwargs, match", [
    (dict(max_new_tokens=0), "max_new_tokens must be an int >= 1, got 0"),
    (dict(temperature=-1.0), "temperature must be"),
    (dict(top_p=0.0), "top_p must be a number in"),
    (dict(top_k=-2), "top_k must be an int >= 0"),
    (dict(seed=-1), "seed must be an int >= 0"),
])
def test_invalid_sampling_params_fail_before_scheduling(engine, kwargs, match):
    before = engine.stats()["prompt_tokens"]
    with pytest.raises(ValueError, match=match):
        engine.generate([[1, 2, 3]], **kwargs)
    assert engine.stats()["prompt_tokens"] == before


@pytest.mark.parametrize("prompt, match", [([], "non-empty"), ([1, 128], r"\[0, 128\), got 128"), ("text", "no tokenizer")])
def test_bad_prompts_are_refused_at_submit(engine, prompt, match):
    with pytest.raises(ValueError, match=match):
        engine.submit(prompt)


def test_stream_and_submit_give_the_same_tokens(engine, references):
    prompt, n = REQUESTS[3]
    events = list(engine.stream(prompt, max_new_tokens=n))
    assert [e.token_id for e in events] == references[3]
    assert events[-1].finished and events[-1].finish_reason == "length" and not any(e.finished for e in events[:-1])
    result = engine.submit(prompt, SamplingParams(max_new_tokens=n)).result(timeout=30)
    assert result.token_ids == references[3] and result.prompt_tokens == len(prompt)
    assert result.ttft_s > 0 and result.decode_s >= 0


def test_sampling_does_not_depend_on_the_batch(engine):
    params = SamplingParams(max_new_tokens=6, temperature=1.0, top_k=20, top_p=0.9, seed=11)
    alone = engine.submit(REQUESTS[5][0], params).result(timeout=30).token_ids
    handles = [engine.submit(p, params if i == 0 else SamplingParams(max_new_tokens=6, temperature=1.0, seed=i))
               for i, p in enumerate([REQUESTS[5][0], REQUESTS[6][0], REQUESTS[7][0]])]
    assert handles[0].result(timeout=30).token_ids == alone


def test_cancel_frees_the_blocks(engine):
    engine.clear_prefix_cache()
    handle = engine.submit(REQUESTS[0][0], SamplingParams(max_new_tokens=150))
    next(iter(handle))  # the request is running
    handle.cancel()
    result = handle.result(timeout=30)
    assert result.finish_reason == "cancelled" and 1 <= len(result.token_ids) < 150
    engine.clear_prefix_cache()
    assert engine.stats()["blocks_used"] == 0


def test_set_decode_only_between_requests(engine, references):
    """Engine.set_decode: a method EngineConfig refuses and a pending request are refused; between
    requests it switches (one process: local attention whatever is asked) and the caches stay."""
    with pytest.raises(ValueError, match="method must be one of"):
        engine.set_decode("tree", "bogus")
    handle = engine.submit(REQUESTS[0][0], SamplingParams(max_new_tokens=150))
    next(iter(handle))  # running, with 149 tokens to go
    with pytest.raises(ValueError, match=r"1 request\(s\) still pending"):
        engine.set_decode("ring")
    handle.cancel()
    handle.result(timeout=30)
    engine.set_decode("ring", "allreduce")
    assert (engine.config.decode, engine.config.method) == ("local", "allreduce")
    prompt, n = REQUESTS[3]
    assert engine.generate([prompt], max_new_tokens=n)[0].token_ids == references[3]
    with ta.Engine(_model(), nproc=1, cache_tokens=64, block_size=BLOCK, decode_step="static") as static:
        with pytest.raises(ValueError, match="decode_step='static' keeps the decode it was built with"):
            static.set_decode("tree")


def test_stop_token_ids_end_a_request(engine, references):
    prompt, n = REQUESTS[2]
    stop = references[2][1]
    result = engine.generate([prompt], max_new_tokens=n, stop_token_ids=[stop])[0]
    assert result.finish_reason == "stop" and result.token_ids == references[2][: references[2].index(stop) + 1]


# ------------------------------------------------------------------- rank processes: reuse, death


def test_prefix_reuse_over_a_16k_document_on_two_ranks():
    """The second question over the same 16K-token document reuses the cached document: its
    cached_prompt_tokens cover every full block of the document, and it is prefilled in one step
    where the first took several (counted, not timed: a time ratio is at the mercy of the load)."""
    g = torch.Generator().manual_seed(9)
    doc = torch.randint(0, 128, (16000,), generator=g).tolist()
    questions = [torch.randint(0, 128, (12,), generator=g).tolist() for _ in range(2)]
    small = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=1,
                        head_dim=16, max_position_embeddings=32768)  # the 16K prefill stays a few seconds
    with ta.Engine(random_model(small, seed=3, std=0.15), nproc=2, decode="tree", placement="interleaved", block_size=256,
                   cache_tokens=32768, prefill_chunk=4096, threads_per_rank=1) as engine:
        results, prefill_steps = [], []
        for q in questions:
            engine.rank_measurements(reset=True)
            results += engine.generate([doc + q], max_new_tokens=4)
            prefill_steps.append(engine.rank_measurements()[0].steps.get("prefill", 0))
        first, second = results
        assert first.cached_prompt_tokens == 0
        assert second.cached_prompt_tokens >= len(doc) // 256 * 256
        assert prefill_steps[1] == 1 < prefill_steps[0], prefill_steps
        engine.clear_prefix_cache()
        assert engine.stats()["blocks_used"] == 0
    assert not multiprocessing.active_children()


def test_a_dead_rank_fails_the_engine_in_the_driver_and_leaves_no_process():
    with ta.Engine(_model(), nproc=2, decode="tree", block_size=BLOCK, cache_tokens=256, timeout_s=10,
                   threads_per_rank=1) as engine:
        assert engine.generate([REQUESTS[1][0]], max_new_tokens=2)[0].finish_reason == "length"
        victim = next(p for p in multiprocessing.active_children() if p.name == "treeattn-rank1")
        victim.kill()
        start = time.monotonic()
        # Idle, the engine fails as soon as the supervisor sees the death (a rank killed under a step
        # fails that step and the ranks restart instead: test_serve_controls.py). Wait for the idle
        # case, so that the request below cannot race the supervisor into the other one.
        while engine.healthy and time.monotonic() - start < 10 * 12:
            time.sleep(0.05)
        with pytest.raises(EngineError, match=r"rank 1 \(pid \d+\) failed: .*SIGKILL"):
            engine.generate([REQUESTS[1][0]], max_new_tokens=2)
        # a backstop against a hang, not a speed claim: the survivor's collective ends at the latest
        # after timeout_s (10 s); the margin is for a loaded machine (seen at load 20)
        assert time.monotonic() - start < 10 * 12
        assert not engine.healthy
        with pytest.raises(EngineError):
            engine.submit([1, 2, 3])
    assert not multiprocessing.active_children()


def test_threads_per_rank_sets_the_threads_of_a_one_process_engine(monkeypatch):
    """nproc=1: the rank is this process, its steps run in the engine's driver thread; threads_per_rank sets its torch
    threads (until session 24 only a spawned rank's were set, and a one-process engine kept the caller's count)."""
    from treeattn.engine.worker import runner

    seen, step = [], runner.RankRunner._step

    def counting_step(self, *args, **kwargs):
        seen.append(torch.get_num_threads())
        return step(self, *args, **kwargs)

    monkeypatch.setattr(runner.RankRunner, "_step", counting_step)
    before = torch.get_num_threads()
    try:
        with ta.Engine(_model(), nproc=1, cache_tokens=64, block_size=BLOCK, threads_per_rank=before + 1) as engine:
            engine.generate([[1, 2, 3]], max_new_tokens=2)
    finally:
        torch.set_num_threads(before)
    assert seen and set(seen) == {before + 1}


def test_text_streams_and_a_stop_string_cuts_it(references):
    model = _model()
    model.tokenizer = LetterTokenizer()
    prompt, n = REQUESTS[7]
    expected = LetterTokenizer().decode(references[7])
    with ta.Engine(model, nproc=1, cache_tokens=256, block_size=BLOCK) as engine:
        events = list(engine.stream(prompt, max_new_tokens=n))
        assert "".join(e.text for e in events) == expected
        result = engine.generate([prompt], max_new_tokens=n, stop=expected[2:4])[0]
        assert engine.generate("abcd", max_new_tokens=1)[0].prompt_tokens == 4  # a string goes through the tokenizer
    cut = expected.index(expected[2:4])  # the stop string's first occurrence
    assert result.finish_reason == "stop" and result.text == expected[:cut]
    assert result.token_ids == references[7][: cut + 2]


@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_checkpoint_directory_matches_transformers_uncached_greedy(tmp_path, arch):
    """An HF checkpoint directory (Llama 3 rope scaling + bias; Mistral's sliding window of 8),
    three prompts batched with chunked prefill, against transformers' full forward per new token."""
    transformers = pytest.importorskip("transformers")  # noqa: F841
    from helpers.llama_checkpoints import make_checkpoint

    hf = make_checkpoint(arch, tmp_path / arch)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 128, (n,), generator=g).tolist() for n in (13, 4, 21)]
    expected = []
    with torch.no_grad():
        for prompt in prompts:
            ids = list(prompt)
            for _ in range(10):
                ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
            expected.append(ids[len(prompt):])
    with ta.Engine(tmp_path / arch, nproc=1, cache_tokens=128, block_size=4, prefill_chunk=5) as engine:
        assert [r.token_ids for r in engine.generate(prompts, max_new_tokens=10)] == expected


def test_non_finite_logits_fail_that_request_alone(engine, references):
    """A request whose logits are not finite ends with an error (never a token); the others go on
    and its blocks are not cached. The model is poisoned for one token id only."""
    assert 127 not in REQUESTS[1][0]
    model = _model()
    with torch.no_grad():
        model.embed_tokens.weight[127] = float("nan")
    with ta.Engine(model, nproc=1, cache_tokens=256, block_size=BLOCK) as poisoned:
        bad, good = poisoned.generate([[127] * 9, REQUESTS[1][0]], max_new_tokens=REQUESTS[1][1])
        assert bad.finish_reason == "error" and "not finite" in bad.error and bad.token_ids == []
        assert good.finish_reason == "length" and good.token_ids == references[1]
        assert poisoned.healthy and poisoned.stats()["blocks_cached"] == poisoned.stats()["blocks_used"]


def test_the_finiteness_check_catches_nan_and_both_infinities_anywhere():
    from treeattn.engine.worker.runner import all_finite

    logits = torch.randn(3, 1000, generator=torch.Generator().manual_seed(0))
    logits[1, 7] = 3.0e38  # large but finite
    assert all_finite(logits)
    for value in (float("nan"), float("inf"), float("-inf")):
        for row, column in ((0, 0), (1, 500), (2, 999)):
            poisoned = logits.clone()
            poisoned[row, column] = value
            assert not all_finite(poisoned), (value, row, column)


def test_an_idle_engine_outlives_the_group_timeout():
    """Ranks wait for the next plan in a collective; an idle driver keeps them short of its timeout.
    The timeout is 5 s, not less: a rank starved of the CPU on a loaded machine (load 21 on 2 cores
    was seen) must still beat and answer within it; the idle wait is over twice the timeout."""
    with ta.Engine(_model(), nproc=2, block_size=16, cache_tokens=512, timeout_s=5.0, threads_per_rank=1) as engine:
        first = engine.generate([[3, 4, 5]], max_new_tokens=2)[0]
        time.sleep(12)
        assert engine.healthy
        assert engine.generate([[3, 4, 5]], max_new_tokens=2)[0].token_ids == first.token_ids
