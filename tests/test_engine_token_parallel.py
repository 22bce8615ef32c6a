"""Token-parallel steps in the engine (treeattn.engine.worker.token_parallel): a step of enough tokens is
cut into p slices and rank r runs only its slice through the model; attention gathers the slices'
queries and keys and combines across the ranks.

Checked on p = 2 and 3 (one spawn of 3 ranks, engines on sub-groups), tree and ring decoding, both
placements, prefix cache on and off, run-by-run reads and gathers: greedy tokens of split steps ==
those of replicated steps == transformers-free uncached recomputation (a full forward pass per new
token); and every rank's model saw exactly its slice of each split step (a forward hook counts the
rows). The threshold is lowered (SPLIT_MIN tokens per rank) so that steps of the tiny test
workload split: prompt chunks (lengths not divisible by p), chunks mixed with decoding sequences,
and decode-only steps of enough sequences; smaller decode steps stay replicated. The engines run
prefill="split" (prompt-only steps would otherwise be ring steps: test_engine_ring_prefill.py).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import treeattn as ta
from treeattn.engine.worker import batch, runner, token_parallel
from treeattn.engine import SamplingParams
from treeattn.parallel import spawn
from helpers.token_parallel import SPLIT_MIN, OPTIONS, _model, REQUESTS, _uncached_greedy  # noqa: E402

CASES = [  # (p, engine options, read shards run by run)
    (2, dict(decode="tree", placement="contiguous", prefix_cache=True), False),
    (2, dict(decode="ring", placement="interleaved", prefix_cache=False), False),
    (3, dict(decode="tree", placement="interleaved", prefix_cache=True), True),
    (3, dict(decode="tree", method="tree", placement="contiguous", prefix_cache=False), True),
    (3, dict(decode="ring", placement="contiguous", prefix_cache=True), False),
]


def _record_steps(model) -> list:
    """Log (T, decoding chunks, prefill chunks, [rows the model ran]) of every step this rank runs."""
    log, seen = [], []
    model.register_forward_pre_hook(lambda module, args: seen.append(args[0].shape[1]))
    step = runner.RankRunner.step

    def logged(self, plan):
        seen.clear()
        out = step(self, plan)
        if plan.chunks:
            log.append((sum(len(c.tokens) for c in plan.chunks), sum(c.decoding for c in plan.chunks),
                        sum(not c.decoding for c in plan.chunks), list(seen)))
        return out

    runner.RankRunner.step = logged
    return log


def _cases(rank: int, world_size: int) -> list[dict]:
    torch.set_num_threads(1)
    model = _model()
    log = _record_steps(model)
    groups = {2: dist.new_group([0, 1]), 3: None}
    out = []
    for p, options, copy_free in CASES:
        if rank >= p:
            continue
        batch.COPY_FREE_MIN_KEYS = 0 if copy_free else 1 << 40
        for split in (True, False):
            token_parallel.SPLIT_MIN_TOKENS_PER_RANK = SPLIT_MIN if split else 1 << 40
            del log[:]
            with ta.Engine(model, group=groups[p], prefill="split", **OPTIONS, **options) as engine:
                run = dict(p=p, options=options, split=split, rank=rank)
                if engine.is_driver:
                    run["tokens"] = []
                    for wave in (REQUESTS[:6], REQUESTS[6:]):  # the second wave finds the first's prefix cached
                        handles = [engine.submit(prompt, SamplingParams(max_new_tokens=n)) for prompt, n in wave]
                        run["tokens"] += [h.result(timeout=60).token_ids for h in handles]
                    run["prefix_hit_tokens"] = engine.stats()["prefix_hit_tokens"]
            run["steps"] = list(log)
            out.append(run)
    return out


@pytest.fixture(scope="module")
def runs():
    return [run for rank_runs in spawn(_cases, 3, timeout=300) for run in rank_runs]


@pytest.fixture(scope="module")
def oracle():
    model = _model()
    return [_uncached_greedy(model, prompt, n) for prompt, n in REQUESTS]


def test_every_case_ran_on_every_rank(runs):
    assert sorted((r["p"], r["rank"], r["split"]) for r in runs) == sorted(
        (p, rank, split) for p, _, _ in CASES for rank in range(p) for split in (True, False))


@pytest.mark.parametrize("case", range(len(CASES)), ids=[f"p{p}-{o['decode']}-{o.get('method', 'onepass')}-{o['placement']}"
                                                          f"-prefix{int(o['prefix_cache'])}-{'runs' if c else 'gather'}"
                                                          for p, o, c in CASES])
def test_split_steps_give_the_tokens_of_replicated_steps_and_of_the_oracle(runs, oracle, case):
    p, options, _ = CASES[case]
    driver = {r["split"]: r for r in runs if r["p"] == p and r["options"] == options and r["rank"] == 0}
    assert driver[True]["tokens"] == oracle
    assert driver[False]["tokens"] == oracle
    if options["prefix_cache"]:  # the second wave reused the shared prefix
        assert driver[True]["prefix_hit_tokens"] >= 28 and driver[False]["prefix_hit_tokens"] >= 28


def test_each_rank_runs_only_its_slice_of_a_split_step(runs):
    kinds = set()
    for run in runs:
        p, rank = run["p"], run["rank"]
        assert run["steps"]
        for total, decoding, prefilling, seen in run["steps"]:
            if run["split"] and total >= SPLIT_MIN * p:
                bounds = token_parallel.row_bounds(total, p)
                assert seen == [bounds[rank + 1] - bounds[rank]], (run["options"], total)
                kinds.add(("uneven" if total % p else "even", "mixed" if decoding and prefilling else
                           "prefill" if prefilling else "decode"))
            else:
                assert seen == [total], (run["options"], run["split"], total)
    # The workload split uneven and even steps, prompt chunks mixed with decoding sequences, and
    # prefill-only and decode-only steps.
    assert {("uneven", "mixed"), ("even", "mixed"), ("uneven", "prefill"), ("uneven", "decode")} <= kinds, kinds


@pytest.mark.parametrize("total, p", [(1, 1), (7, 2), (8, 2), (10, 3), (11, 3), (64, 3), (5, 5)])
def test_row_bounds_cut_near_equal_contiguous_slices(total, p):
    bounds = token_parallel.row_bounds(total, p)
    sizes = [b - a for a, b in zip(bounds, bounds[1:])]
    assert bounds[0] == 0 and bounds[-1] == total and len(sizes) == p
    assert max(sizes) - min(sizes) <= 1 and min(sizes) >= 0


def test_a_split_needs_enough_tokens_per_rank():
    n = token_parallel.SPLIT_MIN_TOKENS_PER_RANK
    assert not token_parallel.splits(10**6, 1)
    assert token_parallel.splits(2 * n, 2) and not token_parallel.splits(2 * n - 1, 2)


def _mla_engine(rank: int, world_size: int, checkpoint: str, prompts: list[list[int]], new_tokens: int):
    torch.set_num_threads(1)
    token_parallel.SPLIT_MIN_TOKENS_PER_RANK = 1
    out = {}
    # prompt-only steps token-parallel, then as ring steps (treeattn.engine.worker.ring_prefill)
    for prefill in ("split", "ring"):
        with ta.Engine(checkpoint, decode="tree", placement="interleaved", block_size=4, cache_tokens=128, prefill=prefill,
                       timeout_s=60) as engine:
            if engine.is_driver:
                out[prefill] = [r.token_ids for r in engine.generate(prompts, max_new_tokens=new_tokens, ignore_eos=True)]
    return out


def test_split_and_ring_steps_over_a_latent_cache_match_transformers(tmp_path):
    """DeepSeek-V3 (MLA: the cache holds latent entries, values a view of the keys) on 2 ranks with
    every step split (prompt-only steps token-parallel, then ring steps): greedy tokens equal
    transformers' uncached recomputation."""
    pytest.importorskip("transformers")
    from helpers.deepseek_checkpoints import NEW_TOKENS, PROMPT, make_checkpoint, uncached_greedy

    hf = make_checkpoint("v3", tmp_path / "v3")
    prompts = [PROMPT, PROMPT[:6]]
    expected = [uncached_greedy(hf, prompt) for prompt in prompts]
    assert spawn(_mla_engine, 2, str(tmp_path / "v3"), prompts, NEW_TOKENS, timeout=120)[0] == {"split": expected,
                                                                                                "ring": expected}
