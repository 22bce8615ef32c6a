"""Speculative decoding in ta.Engine (prompt lookup): greedy tokens with speculation equal each
request alone without it (ta.generate) on p = 1, 2, 3 ranks, tree and ring decoding, both
placements, prefix cache on and off, under cache pressure; rejected drafts give their blocks back;
sampling stays reproducible by seed; bad options fail at construction.

Two tiny random Llamas over a 32-token vocabulary: a plain one, whose greedy continuations revisit
short n-grams now and then (few drafts accepted, most rejected), and a "looping" one whose
attention output is scaled down (o_proj x 0.05), so that its continuations cycle for a while and
then break away (runs of accepted drafts, then rejections). Configurations alternate between them.
The scheduler is also driven alone with a fake model whose
continuation of every request is fixed, so that long accepted runs, cuts at stop tokens and
max_new_tokens, and block pressure are covered exactly (hypothesis).
"""

from __future__ import annotations

import multiprocessing

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings, strategies as st

import treeattn as ta
from treeattn.cache.blocks import ShardedBlockPool, tokens_to_blocks
from treeattn.cache.prefix import PrefixCache
from treeattn.engine.worker import batch
from treeattn.engine import SamplingParams
from treeattn.engine.scheduler import Scheduler
from treeattn.parallel import spawn
from treeattn.engine.speculate import NgramDrafter
from helpers.speculate_engine import BLOCK, _model, REQUESTS, PLENTY, TIGHT, _greedy_alone, SAMPLED  # noqa: E402
from helpers.letters import LetterTokenizer  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one torch thread (conftest.py)

K = 4


CASES = [
    (1, dict(decode="local", placement="contiguous", prefix_cache=True, **PLENTY)),
    (1, dict(decode="local", placement="interleaved", prefix_cache=False, **TIGHT)),
    (2, dict(decode="tree", placement="contiguous", prefix_cache=True, **TIGHT)),
    (2, dict(decode="ring", placement="interleaved", prefix_cache=False, **PLENTY)),
    (3, dict(decode="tree", method="tree", placement="interleaved", prefix_cache=False, **PLENTY)),
    (3, dict(decode="ring", placement="contiguous", prefix_cache=True, **TIGHT)),
]


@pytest.fixture(scope="module")
def references():
    return {looping: _greedy_alone(_model(looping)) for looping in (False, True)}


@pytest.fixture(scope="module")
def sampled_references():
    """The sampled requests on one rank without speculation (ta.Engine: its own generator per request)."""
    out = {}
    for looping in (False, True):
        with ta.Engine(_model(looping), nproc=1, cache_tokens=512, block_size=BLOCK) as engine:
            out[looping] = [engine.submit(REQUESTS[i][0], params).result(timeout=60).token_ids for i,
                            params in enumerate(SAMPLED)]
    return out


def _looping(case: int) -> bool:
    return case % 2 == 1


def _engine_cases(rank: int, world_size: int) -> list[dict]:
    torch.set_num_threads(1)
    models = {looping: _model(looping) for looping in (False, True)}
    groups = {1: dist.new_group([0]), 2: dist.new_group([0, 1]), 3: None}
    out = []
    for case, (p, options) in enumerate(CASES):
        if rank >= p:
            continue
        batch.COPY_FREE_MIN_KEYS = 0 if case % 3 else 1 << 40  # some cases read shards run by run, the others gather them
        with ta.Engine(models[_looping(case)], group=groups[p], timeout_s=60, speculate="ngram", draft_tokens=K,
                       **options) as engine:
            if not engine.is_driver:
                continue
            handles = [engine.submit(prompt, SamplingParams(max_new_tokens=n)) for prompt, n in REQUESTS]
            sampled = [engine.submit(REQUESTS[i][0], params) for i, params in enumerate(SAMPLED)]
            results = [h.result(timeout=120) for h in handles + sampled]
            stats = engine.stats()
            engine.clear_prefix_cache()
            out.append(dict(p=p, options=options, tokens=[r.token_ids for r in results[: len(REQUESTS)]],
                            sampled=[r.token_ids for r in results[len(REQUESTS):]], spec=[r.speculation for r in results],
                            stats=stats, cleared=engine.stats()))
    return out


@pytest.fixture(scope="module")
def runs():
    return spawn(_engine_cases, 3, timeout=300)[0]


def test_every_configuration_ran(runs):
    assert [(r["p"], r["options"]) for r in runs] == CASES


@pytest.mark.parametrize("case", range(len(CASES)), ids=[f"p{p}-{o['decode']}-{o['placement']}-prefix{int(o['prefix_cache'])}"
                                                          f"-{'tight' if o['cache_tokens'] < 100 else 'plenty'}" for p,
                                                         o in CASES])
def test_greedy_tokens_with_speculation_equal_each_request_alone(runs, references, case):
    assert runs[case]["tokens"] == references[_looping(case)]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_sampled_tokens_with_speculation_equal_those_without(runs, sampled_references, case):
    """Drafts are verified by sampling each position as decoding does (RankRunner._sample): the
    same seed gives the same tokens, speculation or not, whatever the batch."""
    assert runs[case]["sampled"] == sampled_references[_looping(case)]


def test_drafts_were_accepted_and_rejected_and_counted(runs):
    for run in runs:
        stats = run["stats"]
        assert 0 < stats["accepted_tokens"] < stats["drafted_tokens"], run["options"]
        assert stats["drafted_tokens"] == sum(s["drafted"] for s in run["spec"])
        assert stats["accepted_tokens"] == sum(s["accepted"] for s in run["spec"])
        assert stats["acceptance_rate"] == stats["accepted_tokens"] / stats["drafted_tokens"]
        decoded, forwards = sum(s["decoded_tokens"] for s in run["spec"]), sum(s["decode_forwards"] for s in run["spec"])
        assert decoded <= sum(len(t) for t in run["tokens"] + run["sampled"])  # a prefill's token is not a decode step's
        assert forwards == stats["decode_forwards"] and stats["tokens_per_forward"] == pytest.approx(decoded / forwards)
        assert stats["tokens_per_forward"] > 1
    for case, run in enumerate(runs):
        if _looping(case):  # runs of accepted drafts
            assert run["stats"]["tokens_per_forward"] >= 1.3 and max(s["tokens_per_forward"] for s in run["spec"]) >= 2, \
                [(run["stats"]["tokens_per_forward"], [s["tokens_per_forward"] for s in run["spec"]])]


def test_no_block_leaks_after_the_cache_is_cleared(runs):
    for run in runs:
        assert run["stats"]["running"] == run["stats"]["waiting"] == 0
        assert run["cleared"]["blocks_used"] == 0 and run["cleared"]["blocks_cached"] == 0
    assert any(run["stats"]["prefix_hit_tokens"] > 0 for run in runs if run["options"]["prefix_cache"])


# ------------------------------------------------------------------- the scheduler alone, a fake model


class _KnowingModel:
    """A fake model that continues request i with targets[i], whatever it is given: it accepts the
    longest prefix of the drafts that agrees with the target and adds the target's next token.
    It also checks every chunk: blocks for every position, the context it runs is the request's,
    drafts never past max_new_tokens."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.seqs, self.targets = {}, {}

    def add(self, prompt: list[int], target: list[int], max_new_tokens: int, stop: frozenset[int]):
        seq = self.scheduler.add(prompt, SamplingParams(max_new_tokens=max_new_tokens), stop)
        self.seqs[seq.seq_id], self.targets[seq.seq_id] = seq, target
        return seq

    def step(self, plan) -> dict[int, list[int]]:
        bs = self.scheduler.pool.block_size
        out = {}
        for c in plan.chunks:
            seq, target = self.seqs[c.seq_id], self.targets[c.seq_id]
            assert len(c.blocks) >= tokens_to_blocks(c.start + len(c.tokens), bs)
            known = c.start + len(c.tokens) - c.num_draft
            assert list(c.tokens[: len(c.tokens) - c.num_draft]) == (seq.prompt + target)[c.start : known]
            if c.sample is None:
                continue
            done = known - len(seq.prompt)  # tokens generated before this step
            assert c.num_draft <= K and done + c.num_draft < seq.params.max_new_tokens
            draft = list(c.tokens[len(c.tokens) - c.num_draft :])
            accepted = 0
            while accepted < len(draft) and draft[accepted] == target[done + accepted]:
                accepted += 1
            out[c.seq_id] = draft[:accepted] + [target[done + accepted]]
        return out


def _drive(model: _KnowingModel, max_steps: int = 5000) -> None:
    s = model.scheduler
    for _ in range(max_steps):
        if not s.has_work:
            return
        plan = s.schedule()
        s.complete(plan, model.step(plan))
        for seq in s.running:  # rolled back: no block past the computed tokens
            assert len(seq.blocks) == tokens_to_blocks(seq.num_computed, s.pool.block_size)
    raise AssertionError("the scheduler did not finish")


def _expected(target: list[int], max_new_tokens: int, stop: frozenset[int]) -> list[int]:
    out = target[:max_new_tokens]
    cut = next((i for i, t in enumerate(out) if t in stop), None)
    return out if cut is None else out[: cut + 1]


@settings(max_examples=60, deadline=None)
@given(p=st.integers(1, 3), blocks=st.integers(2, 6), bs=st.integers(1, 4),
       placement=st.sampled_from(["contiguous", "interleaved"]),
       prefix=st.booleans(), batch=st.integers(1, 5), chunk=st.integers(1, 9), data=st.data())
def test_speculating_scheduler_commits_exactly_the_target_and_frees_every_block(p, blocks, bs, placement, prefix, batch, chunk,
                                                                                data):
    pool = ShardedBlockPool(world_size=p, blocks_per_rank=blocks, block_size=bs, placement=placement)
    tree = PrefixCache(pool) if prefix else None
    model = _KnowingModel(Scheduler(pool, max_batch_size=batch, prefill_chunk=chunk, prefix_cache=tree, drafter=NgramDrafter(),
                                    draft_tokens=K))
    fits = pool.max_tokens_per_sequence
    cases = []
    for _ in range(data.draw(st.integers(1, 6))):
        n = data.draw(st.integers(1, fits - 1))
        prompt = data.draw(st.lists(st.integers(0, 2), min_size=n, max_size=n))  # few ids: drafts are found, and often right
        new = data.draw(st.integers(1, fits - n))
        period = data.draw(st.integers(1, 3))
        target = (data.draw(st.lists(st.integers(0, 2), min_size=period, max_size=period)) * fits)[:new]
        stop = frozenset(data.draw(st.sets(st.integers(0, 4), max_size=1)))
        cases.append((model.add(prompt, target, new, stop), _expected(target, new, stop)))
    _drive(model)
    for seq, expected in cases:
        assert seq.generated == expected and seq.finish_reason == ("stop" if expected[-1] in seq.stop_token_ids else "length")
    assert model.scheduler.accepted <= model.scheduler.drafted
    if tree is not None:
        tree.clear()
    assert pool.num_free == pool.num_blocks


def test_drafts_never_preempt_and_are_cut_when_blocks_are_short():
    """Two sequences in a cache that holds both without drafts but not with all of them: the
    younger is never preempted, the older's drafts shrink to the slots left."""
    pool = ShardedBlockPool(world_size=1, blocks_per_rank=5, block_size=2, placement="contiguous")
    model = _KnowingModel(Scheduler(pool, max_batch_size=2, prefill_chunk=64, prefix_cache=None, drafter=NgramDrafter(),
                                    draft_tokens=K))
    a = model.add([1, 2, 1, 2], [1, 2] * 2, 4, frozenset())  # 4 + 4 tokens: 4 blocks at the end
    b = model.add([3, 4], [3, 4], 2, frozenset())  # 2 + 2 tokens: 2 blocks
    plan = model.scheduler.schedule()
    model.scheduler.complete(plan, model.step(plan))  # both prefilled, one token each
    plan = model.scheduler.schedule()
    drafts = {c.seq_id: c.num_draft for c in plan.chunks}
    assert drafts[a.seq_id] == 1 and drafts[b.seq_id] == 0  # a: 2 wanted, 1 slot left; b: its last token (no room to draft)
    assert pool.num_free == 0
    model.scheduler.complete(plan, model.step(plan))
    _drive(model)
    assert a.generated == [1, 2, 1, 2] and b.generated == [3, 4] and a.preemptions == b.preemptions == 0
    assert model.scheduler.accepted >= 1 and pool.num_free == pool.num_blocks


# ------------------------------------------------------------------- one process: API, sampling, bad input


@pytest.fixture(scope="module")
def engine():
    with ta.Engine(_model(looping=True), nproc=1, cache_tokens=512, block_size=BLOCK, prefill_chunk=16, max_batch_size=4,
                   speculate="ngram", draft_tokens=K) as e:
        yield e


def test_stream_events_come_one_per_token_in_order(engine, references):
    prompt, n = REQUESTS[4]
    events = list(engine.stream(prompt, max_new_tokens=n))
    assert [e.token_id for e in events] == references[True][4]
    assert events[-1].finished and not any(e.finished for e in events[:-1])


def test_a_stop_token_inside_an_accepted_run_cuts_it(engine, references):
    """Stop at each token of a reference in turn: whichever step committed it, the output ends there."""
    prompt, n = REQUESTS[2]
    expected = references[True][2]
    for i in range(1, len(expected)):
        if expected[i] in expected[:i]:
            continue  # an earlier occurrence would stop first
        result = engine.generate([prompt], max_new_tokens=n, stop_token_ids=[expected[i]])[0]
        assert result.token_ids == expected[: i + 1] and result.finish_reason == "stop"
    engine.clear_prefix_cache()
    assert engine.stats()["blocks_used"] == 0


def test_sampling_with_speculation_is_reproducible_by_seed(engine):
    """The same seed twice (alone, then batched with others and from the prefix cache) gives the
    same tokens; another seed other tokens."""
    params = SamplingParams(max_new_tokens=20, temperature=0.8, top_k=16, top_p=0.95, seed=7)
    prompt = REQUESTS[0][0]
    alone = engine.submit(prompt, params).result(timeout=30)
    others = [engine.submit(p, SamplingParams(max_new_tokens=20, temperature=1.0, seed=i)) for i, (p,
                                                                                                   _) in enumerate(REQUESTS[1:4])]
    again = engine.submit(prompt, params).result(timeout=30)
    assert [h.result(timeout=30).finish_reason for h in others] == ["length"] * 3
    assert again.token_ids == alone.token_ids and again.cached_prompt_tokens > 0
    assert alone.speculation["accepted"] > 0 and again.speculation["accepted"] > 0
    other_seed = engine.submit(prompt, SamplingParams(max_new_tokens=20, temperature=0.8, top_k=16, top_p=0.95, seed=8))
    assert other_seed.result(timeout=30).token_ids != alone


def test_cancel_mid_speculation_frees_the_blocks(engine):
    engine.clear_prefix_cache()
    handle = engine.submit(REQUESTS[0][0], SamplingParams(max_new_tokens=400))
    events = iter(handle)
    for _ in range(30):  # well into the decode, drafting
        next(events)
    handle.cancel()
    result = handle.result(timeout=30)
    assert result.finish_reason == "cancelled" and 30 <= len(result.token_ids) < 400
    assert result.speculation["drafted"] > 0
    engine.clear_prefix_cache()
    assert engine.stats()["blocks_used"] == 0


def test_a_stop_string_inside_an_accepted_run_cuts_the_text(references):
    model = _model(looping=True)
    model.tokenizer = LetterTokenizer()
    prompt, n = REQUESTS[2]
    expected = LetterTokenizer().decode(references[True][2])
    with ta.Engine(model, nproc=1, cache_tokens=256, block_size=BLOCK, speculate="ngram", draft_tokens=K) as engine:
        for stop in {expected[i : i + 2] for i in range(2, len(expected) - 2, 3)}:
            result = engine.generate([prompt], max_new_tokens=n, stop=stop)[0]
            cut = expected.index(stop)
            assert result.finish_reason == "stop" and result.text == expected[:cut]
            assert result.token_ids == references[True][2][: cut + 2]


@pytest.mark.parametrize("kwargs, match", [
    (dict(speculate="draft"), r"speculate='draft' needs draft_model=PATH"),
    (dict(speculate="tree"), r"speculate must be None or one of \('ngram', 'draft'\), got 'tree'"),
    (dict(speculate="ngram", draft_tokens=0), r"draft_tokens must be an int in \[1, 16\], got 0"),
    (dict(speculate="ngram", draft_tokens=17), r"draft_tokens must be an int in \[1, 16\], got 17"),
    (dict(speculate="ngram", draft_tokens=2.0), r"draft_tokens must be an int in \[1, 16\], got 2.0"),
    (dict(speculate="ngram", draft_tokens=True), r"draft_tokens must be an int in \[1, 16\], got True"),
])
def test_bad_speculation_options_fail_at_construction(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ta.Engine(_model(), nproc=2, **kwargs)  # before any rank process starts
    assert not multiprocessing.active_children()


def test_serve_refuses_bad_speculation_flags_before_any_work(tmp_path):
    from typer.testing import CliRunner

    from treeattn.cli import app

    model = tmp_path / "model.gguf"
    model.write_bytes(b"")  # never read: the engine's options are checked first
    result = CliRunner().invoke(app, ["serve", str(model), "--speculate", "ngram", "--draft-tokens", "0", "--port", "0"])
    assert result.exit_code == 2 and "--draft-tokens must be an int in [1, 16], got 0" in result.output  # the flag, named
    result = CliRunner().invoke(app, ["serve", str(model), "--speculate", "draft", "--port", "0"])
    assert result.exit_code == 2 and "--speculate draft needs --draft-model PATH" in result.output
