"""Ring prefill steps in the engine (treeattn.engine.worker.ring_prefill): a step of prompt chunks only is
spread over the ranks in zigzag pieces; attention is local over the step's gathered keys plus a ring
over each sequence's cached prefix.

Checked on p = 2 and 3 (one spawn of 3 ranks, engines on sub-groups), both placements, prefix cache
on and off: greedy tokens == the uncached transformers-free recomputation (a full forward pass per
new token; the same requests and oracle as test_engine_token_parallel, whose replicated and split
steps give the same tokens). The workload has several prompts of odd lengths in one step, later
chunks of a prompt and prefix-cache hits (a prefix on the ranks before the chunk), and chunks
mixed with decoding sequences (those steps split as before); prompt-only steps are cut at 8 tokens
per rank here (RING_ROWS_PER_RANK, lowered), so that prompts run in several ring steps. Every rank's model saw exactly its
zigzag pieces of each ring step (a forward hook counts the rows). A model with a sliding window
runs split steps under prefill="auto", and ring steps, still exact, under prefill="ring". (A DeepSeek
latent cache under ring steps: test_engine_token_parallel.py.)
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist

import treeattn as ta
from treeattn.engine import EngineConfig, SamplingParams
from treeattn.engine.worker import runner, token_parallel
from treeattn.engine.config import ConfigError
from treeattn.cache.blocks import ShardedBlockPool
from treeattn.engine import config as engine_config
from treeattn.engine.config import idle_prefill_chunk, resolve_prefill
from treeattn.engine.worker.ring_prefill import zigzag_pieces
from treeattn.engine.scheduler import Scheduler
from treeattn.models.llama import random_model
from treeattn.parallel import spawn
from helpers.token_parallel import CONFIG, OPTIONS, REQUESTS, SPLIT_MIN, _model, _uncached_greedy

CASES = [  # (p, engine options)
    (2, dict(decode="tree", placement="contiguous", prefix_cache=True)),
    (3, dict(decode="tree", placement="interleaved", prefix_cache=True)),
    (3, dict(decode="ring", placement="contiguous", prefix_cache=False)),
]
IDLE_ROWS_PER_RANK = 8  # prompt-only steps of 8p tokens: later chunks of a prompt run after a prefix
# every layer windowed (Mistral-like): a window layer beside a global one makes a hybrid cache, which
# ring steps do not run yet (prefill="ring" is refused for it; docs/engine.md)
WINDOW_CONFIG = dataclasses.replace(CONFIG, layer_windows=(5, 5))
WINDOW_REQUESTS = REQUESTS[:4]


def _window_model():
    return random_model(WINDOW_CONFIG, seed=5, std=0.15)


def _record_steps(model) -> list:
    """Log (T, decoding chunks, prefill chunks, chunk lengths, a chunk starts after a prefix, [rows
    the model ran]) of every step this rank runs with `model`."""
    log, seen = [], []
    model.register_forward_pre_hook(lambda module, args: seen.append(args[0].shape[1]))
    step = runner.RankRunner.step

    def logged(self, plan):
        if self.model is not model:
            return step(self, plan)
        seen.clear()
        out = step(self, plan)
        if plan.chunks:
            prefill = [c for c in plan.chunks if not c.decoding]
            log.append((sum(len(c.tokens) for c in plan.chunks), len(plan.chunks) - len(prefill), len(prefill),
                        [len(c.tokens) for c in plan.chunks], any(c.start > 0 for c in prefill), list(seen)))
        return out

    runner.RankRunner.step = logged
    return log


def _run(engine, waves) -> dict:
    out = dict(tokens=[])
    if engine.is_driver:
        for wave in waves:  # a later wave finds the earlier one's prefix cached
            handles = [engine.submit(prompt, SamplingParams(max_new_tokens=n)) for prompt, n in wave]
            out["tokens"] += [h.result(timeout=60).token_ids for h in handles]
        out["prefix_hit_tokens"] = engine.stats()["prefix_hit_tokens"]
    return out


def _cases(rank: int, world_size: int) -> list[dict]:
    torch.set_num_threads(1)
    token_parallel.SPLIT_MIN_TOKENS_PER_RANK = SPLIT_MIN
    engine_config.RING_ROWS_PER_RANK = IDLE_ROWS_PER_RANK
    model, window_model = _model(), _window_model()
    log = _record_steps(model)
    window_log = _record_steps(window_model)
    groups = {2: dist.new_group([0, 1]), 3: None}
    out = []
    for p, options in CASES:
        if rank < p:
            del log[:]
            with ta.Engine(model, group=groups[p], prefill="ring", **OPTIONS, **options) as engine:
                run = dict(p=p, options=options, rank=rank, **_run(engine, (REQUESTS[:6], REQUESTS[6:])))
            out.append(dict(run, steps=list(log)))
    for prefill in ("auto", "ring") if rank < 2 else ():
        del window_log[:]
        with ta.Engine(window_model, group=groups[2], prefill=prefill, **OPTIONS) as engine:
            run = dict(p=2, options=dict(window=prefill), rank=rank, **_run(engine, (WINDOW_REQUESTS,)))
        out.append(dict(run, steps=list(window_log)))
    return out


@pytest.fixture(scope="module")
def runs():
    return [run for rank_runs in spawn(_cases, 3, timeout=300) for run in rank_runs]


@pytest.fixture(scope="module")
def oracle():
    model = _model()
    return [_uncached_greedy(model, prompt, n) for prompt, n in REQUESTS]


@pytest.fixture(scope="module")
def window_oracle():
    model = _window_model()
    return [_uncached_greedy(model, prompt, n) for prompt, n in WINDOW_REQUESTS]


def _driver(runs, p, options) -> dict:
    return next(r for r in runs if r["p"] == p and r["options"] == options and r["rank"] == 0)


@pytest.mark.parametrize("case", range(len(CASES)), ids=[f"p{p}-{o['decode']}-{o['placement']}-prefix{int(o['prefix_cache'])}"
                                                          for p, o in CASES])
def test_ring_steps_give_the_tokens_of_the_oracle(runs, oracle, case):
    p, options = CASES[case]
    driver = _driver(runs, p, options)
    assert driver["tokens"] == oracle
    if options["prefix_cache"]:  # the second wave reused the shared prefix
        assert driver["prefix_hit_tokens"] >= 28


def _ring_rows(plan_lengths: list[int], p: int, rank: int) -> int:
    return sum(hi - lo for n in plan_lengths for lo, hi in zigzag_pieces(n, p, rank))


def test_each_rank_runs_its_zigzag_pieces_of_a_prompt_only_step(runs):
    kinds = set()
    for run in runs:
        p, rank, ring = run["p"], run["rank"], run["options"].get("window", "ring") == "ring"
        assert run["steps"]
        for total, decoding, prefilling, lengths, after_prefix, seen in run["steps"]:
            if total < SPLIT_MIN * p:  # the ranks' threshold (lowered there)
                assert seen == [total]
            elif ring and not decoding:
                assert seen == [_ring_rows(lengths, p, rank)], (run["options"], lengths)
                kinds.add(("several" if prefilling > 1 else "one", "after a prefix" if after_prefix else "first"))
            else:  # with decoding sequences, or a sliding window under auto: a split step
                bounds = token_parallel.row_bounds(total, p)
                assert seen == [bounds[rank + 1] - bounds[rank]], (run["options"], total)
                kinds.add(("split", "mixed" if decoding else "window"))
    assert {("one", "first"), ("several", "after a prefix"), ("split", "mixed"), ("split", "window")} <= kinds, kinds


def test_a_sliding_window_model_is_exact_under_auto_and_ring(runs, window_oracle):
    for prefill in ("auto", "ring"):
        assert _driver(runs, 2, dict(window=prefill))["tokens"] == window_oracle


@pytest.mark.parametrize("n, p", [(1, 2), (7, 2), (16, 2), (10, 3), (11, 3), (64, 3), (5, 4)])
def test_zigzag_pieces_share_rows_and_attention_evenly(n, p):
    pieces = [zigzag_pieces(n, p, r) for r in range(p)]
    rows = sorted(i for rank_pieces in pieces for lo, hi in rank_pieces for i in range(lo, hi))
    assert rows == list(range(n))  # every row once
    counts = [sum(hi - lo for lo, hi in rp) for rp in pieces]
    work = [sum(i + 1 for lo, hi in rp for i in range(lo, hi)) for rp in pieces]  # keys a row attends to
    assert max(counts) - min(counts) <= 2
    assert max(work) - min(work) <= n  # of the n * (n + 1) / 2 query-key pairs: about one row's


def test_prompt_steps_are_larger_while_nothing_decodes():
    pool = ShardedBlockPool(world_size=2, blocks_per_rank=32, block_size=4, placement="contiguous")
    scheduler = Scheduler(pool, max_batch_size=4, prefill_chunk=8, prefix_cache=None, idle_prefill_chunk=32)
    first = scheduler.add(list(range(40)), SamplingParams(max_new_tokens=4), frozenset())
    steps = []
    for _ in range(3):
        plan = scheduler.schedule()
        steps.append([len(c.tokens) for c in plan.chunks])
        scheduler.complete(plan, {c.seq_id: [1] for c in plan.chunks if c.sample is not None})
        if len(steps) == 2:  # `first` decodes from now on: prompt chunks are prefill_chunk again
            scheduler.add(list(range(20)), SamplingParams(max_new_tokens=4), frozenset())
    assert steps == [[32], [8], [1, 8]] and first.generated == [1, 1]
    assert idle_prefill_chunk("auto", 3, (None,)) == 3 * engine_config.RING_ROWS_PER_RANK
    assert idle_prefill_chunk("split", 3, (None,)) is None and idle_prefill_chunk("auto", 2, (8,)) is None


def test_resolve_prefill_and_the_engine_option():
    assert resolve_prefill("auto", 2, (None, None)) == "ring"
    assert resolve_prefill("auto", 2, (8, None)) == "split"
    assert resolve_prefill("ring", 2, (8, None)) == "ring"
    assert resolve_prefill("ring", 1, (None,)) == "split"
    with pytest.raises(ConfigError, match="prefill must be one of"):
        EngineConfig(prefill="zigzag")

