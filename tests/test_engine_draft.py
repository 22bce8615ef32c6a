"""Speculative decoding with a draft model in ta.Engine (speculate="draft", treeattn.engine.worker.draft).

- Greedy tokens with a draft model equal each request alone without speculation (ta.generate, whose
  tokens are checked against an uncached recomputation) on p = 1, 2, 3 ranks (sub-groups of one
  spawn), tree and ring decoding, both placements, prefix cache on and off, under cache pressure
  (preemption), with three drafts: the model itself (every greedy draft accepted: this also checks
  that the draft's cache is valid wherever it is read, prefix-cache hits and recomputations
  included), the model with perturbed weights (drafts accepted and rejected) and a smaller random
  model of another shape (nearly all rejected).
- Sampled tokens equal those without speculation seed by seed (greedy drafts, the coupled rule), and
  follow the model's exact distribution (chi-square over 400 seeds on a tiny model).
- Rollback leaks no block; bad options and drafts that do not fit fail before any rank starts; the
  memory check counts the draft model.
"""

from __future__ import annotations

import multiprocessing

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings, strategies as st

import treeattn as ta
from helpers.speculate_engine import BLOCK, CONFIG, PLENTY, REQUESTS as ALL_REQUESTS, SAMPLED, TIGHT, _greedy_alone, _uncached
from treeattn.cache.blocks import ShardedBlockPool
from treeattn.cache.prefix import PrefixCache
from treeattn.engine.worker import batch, token_parallel
from treeattn.engine import SamplingParams
from treeattn.engine.speculate import DraftSlots
from treeattn.engine.scheduler import Scheduler
from treeattn.engine.config import ConfigError
from treeattn.models.llama import LlamaConfig, random_model
from treeattn.parallel import spawn

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one torch thread (conftest.py)

K = 3
REQUESTS = ALL_REQUESTS[:7]  # three share a prefix
SMALL = LlamaConfig(vocab_size=CONFIG.vocab_size, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=1,
                    head_dim=8, max_position_embeddings=4096)


def _target():
    return random_model(CONFIG, seed=3, std=0.15)


def _draft(name: str, target):
    """"self": the model itself; "near": its weights perturbed; "small": another random model, another shape."""
    if name == "self":
        return target
    if name == "small":
        return random_model(SMALL, seed=4, std=0.15)
    near = random_model(CONFIG, seed=3, std=0.15)
    g = torch.Generator().manual_seed(6)
    with torch.no_grad():
        for p in near.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return near


CASES = [
    (1, "self", dict(decode="local", placement="contiguous", prefix_cache=True, **PLENTY)),
    (1, "small", dict(decode="local", placement="interleaved", prefix_cache=False, **TIGHT)),
    (2, "near", dict(decode="tree", placement="contiguous", prefix_cache=True, **TIGHT)),
    (2, "self", dict(decode="ring", placement="interleaved", prefix_cache=False, shared_memory=False, **PLENTY)),
    (3, "small", dict(decode="tree", method="tree", placement="interleaved", prefix_cache=True, **PLENTY)),
    (3, "self", dict(decode="ring", placement="contiguous", prefix_cache=True, **TIGHT)),
    (3, "near", dict(decode="tree", placement="interleaved", prefix_cache=False, **TIGHT)),
]




def _engine_cases(rank: int, world_size: int) -> list[dict]:
    torch.set_num_threads(1)
    target = _target()
    groups = {1: dist.new_group([0]), 2: dist.new_group([0, 1]), 3: None}
    out = []
    for case, (p, draft, options) in enumerate(CASES):
        if rank >= p:
            continue
        batch.COPY_FREE_MIN_KEYS = 0 if case % 2 else 1 << 40  # some cases read shards run by run, the others gather them
        # some split steps of >= 2p tokens over the ranks
        token_parallel.SPLIT_MIN_TOKENS_PER_RANK = 2 if case % 3 == 2 else 1 << 40
        with ta.Engine(target, group=groups[p], timeout_s=60, speculate="draft", draft_model=_draft(draft, target),
                       draft_tokens=K,
                       **options) as engine:
            if not engine.is_driver:
                continue
            handles = [engine.submit(prompt, SamplingParams(max_new_tokens=n)) for prompt, n in REQUESTS]
            handles += [engine.submit(REQUESTS[i][0], params) for i, params in enumerate(SAMPLED)]
            results = [h.result(timeout=120) for h in handles]
            again = engine.submit(*_repeat(0)).result(timeout=60)  # its prompt's blocks from the prefix cache, if on
            stats = engine.stats()
            engine.clear_prefix_cache()
            out.append(dict(tokens=[r.token_ids for r in results[: len(REQUESTS)]],
                            sampled=[r.token_ids for r in results[len(REQUESTS):]],
                            spec=[r.speculation for r in results], again=again, stats=stats, cleared=engine.stats()))
    return out


def _repeat(i: int):
    return REQUESTS[i][0], SamplingParams(max_new_tokens=REQUESTS[i][1])


@pytest.fixture(scope="module")
def runs():
    return spawn(_engine_cases, 3, timeout=300)[0]


@pytest.fixture(scope="module")
def references():
    """Each request alone without speculation (ta.generate), checked against the uncached oracle: one
    forward pass over prompt + tokens, whose argmax at every position is the next token."""
    model = _target()
    out = _greedy_alone(model)[: len(REQUESTS)]
    for (prompt, _), tokens in zip(REQUESTS, out):
        ids = torch.tensor([prompt + tokens])
        with torch.no_grad():
            hidden = model(ids, torch.arange(ids.shape[1])[None], *_uncached(ids.shape[1]))
        assert model.logits(hidden[0, len(prompt) - 1 : -1]).argmax(-1).tolist() == tokens
    return out


@pytest.fixture(scope="module")
def sampled_references():
    with ta.Engine(_target(), nproc=1, cache_tokens=512, block_size=BLOCK) as engine:
        return [engine.submit(REQUESTS[i][0], params).result(timeout=60).token_ids for i, params in enumerate(SAMPLED)]


IDS = [f"p{p}-{draft}-{o['decode']}-{o['placement']}-prefix{int(o['prefix_cache'])}-"
       f"{'tight' if o['cache_tokens'] < 100 else 'plenty'}"
       for p, draft, o in CASES]


@pytest.mark.parametrize("case", range(len(CASES)), ids=IDS)
def test_greedy_tokens_with_a_draft_model_equal_each_request_alone(runs, references, case):
    run = runs[case]
    assert run["tokens"] == references
    assert run["again"].token_ids == references[0]
    if CASES[case][2]["prefix_cache"]:
        assert run["again"].cached_prompt_tokens > 0


@pytest.mark.parametrize("case", range(len(CASES)), ids=IDS)
def test_sampled_tokens_with_a_draft_model_equal_those_without(runs, sampled_references, case):
    """Greedy drafts are a one-hot proposal: verification samples each position as decoding does,
    so the same seed gives the same tokens."""
    assert runs[case]["sampled"] == sampled_references


@pytest.mark.parametrize("case", range(len(CASES)), ids=IDS)
def test_drafts_accepted_as_the_draft_model_deserves(runs, case):
    """The model as its own draft: every greedy draft accepted (its cache holds the right keys/values
    wherever it is read: after prefix-cache hits, preemptions, rejections, lagging one token);
    perturbed: some accepted, some rejected; another model: nearly all rejected."""
    run, draft = runs[case], CASES[case][1]
    greedy = run["spec"][: len(REQUESTS)] + [run["again"].speculation]
    drafted, accepted = sum(s["drafted"] for s in greedy), sum(s["accepted"] for s in greedy)
    assert drafted > 0 and all(s["method"] == "draft" and s["draft_tokens"] == K for s in greedy)
    if draft == "self":
        assert accepted == drafted, [(s["accepted"], s["drafted"]) for s in greedy]
        assert run["stats"]["tokens_per_forward"] > 2
    elif draft == "near":
        assert 0 < accepted < drafted
    else:
        assert accepted < drafted / 4
    stats = run["stats"]
    assert stats["drafted_tokens"] == sum(s["drafted"] for s in run["spec"]) + run["again"].speculation["drafted"]
    assert stats["accepted_tokens"] == sum(s["accepted"] for s in run["spec"]) + run["again"].speculation["accepted"]


def test_no_block_leaks_after_the_cache_is_cleared(runs):
    for run in runs:
        assert run["stats"]["running"] == run["stats"]["waiting"] == 0
        assert run["cleared"]["blocks_used"] == 0 and run["cleared"]["blocks_cached"] == 0
    assert any(run["stats"]["preemptions"] > 0 for run in runs)


# ------------------------------------------------ the scheduler alone: what each cache holds, modelled


class _TwoCaches:
    """Stands in for the ranks of speculate="draft": per block, the token ids whose keys/values the
    model's cache and the draft's cache hold, written as RankRunner and DraftRunner write them (a
    block is zeroed when a cache writes its first slot), and every read checked (each position a
    forward pass attends to must hold the sequence's token, in the cache of the model that reads).
    The model continues request i with targets[i]; the draft guesses right where `right` says."""

    def __init__(self, scheduler, right: list[bool]) -> None:
        self.scheduler, self.right = scheduler, right
        self.model, self.draft = {}, {}  # BlockRef -> [token id or None] * block_size
        self.seqs, self.truth = {}, {}
        self.guesses = 0

    def add(self, prompt, target, max_new_tokens, stop):
        seq = self.scheduler.add(prompt, SamplingParams(max_new_tokens=max_new_tokens), stop)
        self.seqs[seq.seq_id], self.truth[seq.seq_id] = seq, prompt + target
        return seq

    def _write(self, cache, blocks, start, tokens) -> None:
        bs = self.scheduler.pool.block_size
        for pos, token in enumerate(tokens, start):
            ref = blocks[pos // bs]
            if pos % bs == 0:
                cache[ref] = [None] * bs
            cache[ref][pos % bs] = token

    def _check(self, cache, blocks, end, truth, who) -> None:
        bs = self.scheduler.pool.block_size
        held = [cache.get(blocks[pos // bs], [None] * bs)[pos % bs] for pos in range(end)]
        assert held == truth[:end], f"{who} reads stale keys/values"

    def step(self, plan) -> dict[int, list[int]]:
        out = {}
        for c in plan.chunks:
            truth, lag = self.truth[c.seq_id], len(c.draft_prefix)
            known = list(c.tokens[: len(c.tokens) - c.num_draft])
            self._check(self.draft, c.blocks, c.start - lag, truth, "the draft")  # its catch-up pass
            self._write(self.draft, c.blocks, c.start - lag, list(c.draft_prefix) + known)
            drafts = []
            for i in range(c.num_draft):  # draft i + 1 after its pass over the previous one
                pos = c.start + 1 + i
                self._check(self.draft, c.blocks, pos, truth[: c.start] + known + drafts, "the draft")
                self.guesses += 1
                drafts.append(truth[pos] if self.right[self.guesses % len(self.right)] else -1)
                if i < c.num_draft - 1:
                    self._write(self.draft, c.blocks, pos, [drafts[-1]])
            self._check(self.model, c.blocks, c.start, truth, "the model")
            self._write(self.model, c.blocks, c.start, known + drafts)
            if c.sample is not None:
                done = c.start + len(known)
                accepted = next((i for i, d in enumerate(drafts) if d != truth[done + i]), len(drafts))
                out[c.seq_id] = drafts[:accepted] + [truth[done + accepted]]
        return out

    def check_prefix_cache(self) -> None:
        """Every cached block holds its tokens in both caches: whoever reuses it may read both."""
        tree = self.scheduler.prefix_cache
        for node in tree._nodes():
            assert self.model[node.block] == list(node.key) and self.draft[node.block] == list(node.key), node.key


@settings(max_examples=60, deadline=None)
@given(p=st.integers(1, 3), blocks=st.integers(2, 6), bs=st.integers(1, 4),
       placement=st.sampled_from(["contiguous", "interleaved"]),
       batch=st.integers(1, 4), chunk=st.integers(1, 9), right=st.lists(st.booleans(), min_size=1, max_size=6), data=st.data())
def test_both_caches_hold_what_is_read_and_what_is_cached(p, blocks, bs, placement, batch, chunk, right, data):
    """Prefix cache on: requests repeat each other's prompts and outputs, so cached blocks are reused,
    including blocks completed by a step that accepted all its drafts (the draft's cache lags there)."""
    pool = ShardedBlockPool(world_size=p, blocks_per_rank=blocks, block_size=bs, placement=placement)
    scheduler = Scheduler(pool, max_batch_size=batch, prefill_chunk=chunk, prefix_cache=PrefixCache(pool), drafter=DraftSlots(),
                          draft_tokens=K, draft_cache=True)
    fake = _TwoCaches(scheduler, right)
    fits = pool.max_tokens_per_sequence
    base = data.draw(st.lists(st.integers(0, 3), min_size=fits, max_size=fits))  # every request continues this
    for _ in range(data.draw(st.integers(1, 5))):
        n = data.draw(st.integers(1, fits - 1))
        new = data.draw(st.integers(1, fits - n))
        fake.add(base[:n], base[n:n + new], new, frozenset())
        if data.draw(st.booleans()):  # run the queue now: later requests find its blocks cached
            _drive(fake)
    _drive(fake)
    for seq in fake.seqs.values():
        assert seq.tokens == fake.truth[seq.seq_id][: len(seq.tokens)] and seq.finish_reason == "length"
    scheduler.prefix_cache.clear()
    assert pool.num_free == pool.num_blocks


def _drive(fake: _TwoCaches) -> None:
    s = fake.scheduler
    for _ in range(5000):
        if not s.has_work:
            return
        plan = s.schedule()
        s.complete(plan, fake.step(plan))
        fake.check_prefix_cache()
    raise AssertionError("the scheduler did not finish")


# --------------------------------------------------------------------- temperature > 0, one process


def test_sampled_tokens_with_a_draft_model_follow_the_model_distribution():
    """Temperature 1 with top-k 4 of 5 tokens, another random model as draft: over 400 seeds (one
    engine, batched, prefix cache on) the first three new tokens are, seed by seed, those decoding
    without speculation draws (the coupled rule, whatever the batch: deterministic given the
    seeds), and follow the model's exact distribution (chi-square at P_MIN; the distribution's test
    with power is test_speculate's over 10,000 seeds of the same oracle)."""
    from helpers.speculate_sampling import (P_MIN, SAMPLING, SAMPLING_CONFIG, SAMPLING_PROMPT, check_coupled, chi_square_pvalue,
                                            coupled_tokens, exact_distribution)

    model, draft = random_model(SAMPLING_CONFIG, seed=2, std=0.5), random_model(SAMPLING_CONFIG, seed=5, std=0.5)
    exact = exact_distribution(model, SAMPLING_PROMPT, SAMPLING)
    n = 400
    with ta.Engine(model, nproc=1, block_size=4, cache_tokens=4096, max_batch_size=64, speculate="draft", draft_model=draft,
                   draft_tokens=2) as engine:
        handles = [engine.submit(SAMPLING_PROMPT, SamplingParams(max_new_tokens=3, seed=seed, ignore_eos=True, **SAMPLING))
                   for seed in range(n)]
        results = [h.result(timeout=120) for h in handles]
        stats = engine.stats()
    counts: dict = {}
    for r in results:
        counts[tuple(r.token_ids)] = counts.get(tuple(r.token_ids), 0) + 1
    assert 0 < stats["accepted_tokens"] < stats["drafted_tokens"] and stats["prefix_hit_tokens"] > 0
    check_coupled([tuple(r.token_ids) for r in results], *coupled_tokens(model, SAMPLING_PROMPT, SAMPLING, range(n)))
    assert chi_square_pvalue(counts, exact, n) > P_MIN


# ---------------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("kwargs, option, words", [
    (dict(speculate="draft"), "speculate", "speculate='draft' needs draft_model=PATH"),
    (dict(draft_model="d.gguf"), "draft_model", "draft_model is the drafter of speculate='draft', got no speculation"),
    (dict(speculate="ngram", draft_model="d.gguf"), "draft_model", "got speculate='ngram'"),
    (dict(speculate="draft", draft_model=3), "draft_model", "a checkpoint path or a loaded model, got int"),
    (dict(speculate="draft", draft_model="missing.gguf"), "draft_model",
     "draft_model=missing.gguf is not a usable model checkpoint"),
    (dict(speculate="draft", draft_model=random_model(LlamaConfig(vocab_size=16, hidden_size=16, intermediate_size=32,
                                                                  num_layers=1,
                                                                  num_heads=2, num_kv_heads=1, head_dim=8))),
     "draft_model", "draft_model has a vocabulary of 16 tokens, the model 32"),
    (dict(speculate="draft", cache_tokens=1024, draft_model=random_model(LlamaConfig(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=8,
                                                                                     max_position_embeddings=64))),
     "draft_model", "draft_model's context window of 64 positions is shorter than the 1024 positions the engine runs"),
])
def test_bad_draft_options_fail_before_any_rank_starts(kwargs, option, words):
    with pytest.raises(ConfigError) as info:
        ta.Engine(_target(), nproc=2, block_size=BLOCK, **kwargs)
    assert info.value.option == option and words in str(info.value) and "\n" not in str(info.value)
    assert not multiprocessing.active_children()


def test_a_draft_of_a_short_window_fits_a_small_enough_cache():
    draft = random_model(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2,
                                     num_kv_heads=1,
                                     head_dim=8, max_position_embeddings=64))
    with ta.Engine(_target(), nproc=1, block_size=BLOCK, cache_tokens=64, speculate="draft", draft_model=draft) as engine:
        assert engine.max_context == 64
        assert len(engine.generate([REQUESTS[1][0]], max_new_tokens=8)[0].token_ids) == 8


def test_the_memory_check_counts_the_draft_model(monkeypatch):
    """Memory for two ranks of the model and its cache, not for the draft's too: refused, naming draft_model."""
    from treeattn.engine import memory
    from treeattn.engine.config import EngineConfig
    from treeattn.engine.memory import kv_cache_bytes_per_rank, model_bytes

    target, draft = _target(), random_model(SMALL, seed=4)
    config = EngineConfig(nproc=2, block_size=BLOCK, cache_tokens=1024)
    one_rank = model_bytes(target, torch.float32) + kv_cache_bytes_per_rank(config, CONFIG, torch.float32)
    monkeypatch.setattr(memory, "device_memory_bytes", lambda device: 2 * one_rank + 1)
    with pytest.raises(ValueError,
                       match=r"^draft_model: 2 rank\(s\) x \(.* of weights \+ .* of KV cache \+ .* of draft model and its "
                                         r"cache\) = .*, more than the .* of memory of this machine$"):
        ta.Engine(target, nproc=2, block_size=BLOCK, cache_tokens=1024, speculate="draft", draft_model=draft)
    monkeypatch.setattr(memory, "device_memory_bytes", lambda device: one_rank // 2)
    with pytest.raises(ValueError, match=r"^cache_tokens: 2 rank\(s\) x"):
        ta.Engine(target, nproc=2, block_size=BLOCK, cache_tokens=1024)
    assert not multiprocessing.active_children()


# ----------------------------------------------------------------- the command lines: bad input, memory


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """HF checkpoints with tokenizers: the model, and a draft whose tokenizer swaps two ids."""
    pytest.importorskip("transformers")
    from helpers.llama_checkpoints import make_checkpoint
    from helpers.llama_checkpoints import _save_tokenizer

    root = tmp_path_factory.mktemp("engine_draft")
    for name, options in (("model", {}), ("swapped", dict(swap=True))):
        make_checkpoint("llama", root / name)
        _save_tokenizer(root / name, **options)
    return {name: root / name for name in ("model", "swapped", "missing")}


SERVE = ["--nproc", "2", "--block-size", "16", "--cache-tokens", "256", "--port", "0"]


@pytest.mark.parametrize("extra, words", [
    (["--draft-model", "{swapped}"], "--draft-model is the drafter of --speculate draft, got no speculation"),
    (["--speculate", "draft"], "--speculate draft needs --draft-model PATH"),
    (["--speculate", "draft", "--draft-model", "{swapped}"],
     "--draft-model has another tokenizer than the model: token 't1' is id 2 in the draft, 1 in the model"),
    (["--speculate", "draft", "--draft-model", "{missing}"], "--draft-model {missing} is not a usable model checkpoint"),
])
def test_serve_refuses_a_bad_draft_model_before_any_rank_starts(checkpoints, extra, words):
    from typer.testing import CliRunner

    from treeattn.cli import app

    names = {name: str(path) for name, path in checkpoints.items()}
    result = CliRunner().invoke(app, ["serve", names["model"], *SERVE, *(e.format(**names) for e in extra)])
    lines = result.output.strip().splitlines()
    assert result.exit_code == 2 and len(lines) == 1 and words.format(**names) in lines[0], result.output
    assert not multiprocessing.active_children()


def test_serve_and_generate_count_the_draft_model_in_the_memory_check(checkpoints, monkeypatch):
    """Memory for two ranks of the model and its cache, not for a draft model as big as the model too."""
    from typer.testing import CliRunner

    from treeattn.cli import app
    from treeattn.engine import memory
    from treeattn.engine.config import EngineConfig
    from treeattn.engine.generate import batch_config
    from treeattn.engine.memory import kv_cache_bytes_per_rank, model_bytes
    from treeattn.engine.request import SamplingParams
    from treeattn.models.loader import read_config

    model = str(checkpoints["model"])
    model_config = read_config(model)
    weights = model_bytes(model, torch.float32)
    served = kv_cache_bytes_per_rank(EngineConfig(nproc=2, block_size=16, cache_tokens=256), model_config, torch.float32)
    monkeypatch.setattr(memory, "device_memory_bytes", lambda device: 2 * (weights + served) + 1)
    result = CliRunner().invoke(app, ["serve", model, *SERVE, "--speculate", "draft", "--draft-model", model])
    assert (
        result.exit_code == 2
        and "error: --draft-model: 2 rank(s) x (" in result.output
        and "of draft model and its cache" in result.output
    )

    prompt = [1, 2, 3, 4, 5, 6, 7, 8]
    kv = kv_cache_bytes_per_rank(batch_config(EngineConfig(), SamplingParams(max_new_tokens=8), 1, [prompt], 2), model_config,
                                 torch.float32)
    monkeypatch.setattr(memory, "device_memory_bytes", lambda device: 2 * (weights + kv) + 1)
    ids = checkpoints["model"].parent / "ids.json"
    ids.write_text(str(prompt))
    result = CliRunner().invoke(app, ["generate", model, "--prompt-ids", str(ids), "--max-new-tokens", "8", "--nproc", "2",
                                      "--speculate", "draft", "--draft-model", model])
    lines = result.output.strip().splitlines()
    assert result.exit_code == 2 and len(lines) == 1 and lines[0].startswith("error: --draft-model: 2 rank(s) x ("), result.output
    assert not multiprocessing.active_children()
