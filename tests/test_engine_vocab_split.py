"""The output projection split over CPU ranks by vocabulary (engine.worker.runner: VOCAB_SPLIT_MIN_WEIGHTS).

A model whose vocab_size x hidden_size reaches the threshold has each of 2 real gloo ranks compute
the logits of its half of the vocabulary, all-gathered to rank 0: the tokens (greedy and sampled, a
batch of two prompts) are those of 2 ranks without the split and of the one-process engine, the
log-probabilities theirs within float32 rounding (each logit is the same dot product, but a BLAS may
sum it in another order for a matrix of half the rows: not the same bits on every host, issue 46); the decode steps count the
gather's round. An odd vocabulary pads the last rank's share. A greedy run without logprobs takes the
greedy fast path (RankRunner._greedy_picks: each rank's maxima, rows x 3 values, instead of its logits):
the same tokens, one small gather a step; its pick (sampling.split_argmax) is checked against the full
row's argmax on crafted shares (ties across shares, NaN, infinities, short and empty shares).
"""

from __future__ import annotations

import pytest
import torch

import treeattn as ta
from treeattn.engine.worker.runner import VOCAB_SPLIT_MIN_WEIGHTS
from treeattn.models.llama import random_model

HIDDEN = 64
NEW_TOKENS = 6
PENALTIES = {"repetition_penalty": 1.5, "logit_bias": {7: 100.0}}  # greedy: token 7 throughout, not the fast path's


def _config(vocab: int) -> ta.LlamaConfig:
    return ta.LlamaConfig(vocab_size=vocab, hidden_size=HIDDEN, intermediate_size=128, num_layers=2, num_heads=4,
                          num_kv_heads=2, head_dim=16)


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, vocab, (40,), generator=g).tolist(), torch.randint(0, vocab, (23,), generator=g).tolist()]


def _generate(rank: int, world_size: int, vocab: int, split: bool = True) -> dict:
    from treeattn.engine.worker import runner

    torch.set_num_threads(1)
    if not split:  # this process's ranks project on rank 0 alone, as below the threshold
        runner.VOCAB_SPLIT_MIN_WEIGHTS = vocab * HIDDEN + 1
    model = random_model(_config(vocab), seed=5, std=0.2)  # large weights: logits far apart, a sharp softmax
    out = {}
    for name, sampling in (("greedy", {}), ("sampled", {"temperature": 0.8, "seed": 9})):
        result = ta.generate(model, _prompts(vocab), max_new_tokens=NEW_TOKENS, ignore_eos=True, logprobs=3,
                             block_size=8, **sampling)
        out[name] = (result.generated_ids, result.token_logprobs)  # a log-softmax over every gathered logit
        out["steps"], out["by_op"] = result.decode_steps, {op: c["calls"] for op,
                                                           c in (result.comm or {}).get("by_op", {}).items()}
    if world_size == 1 and vocab % 2:
        out["penalized"] = ta.generate(model, _prompts(vocab), max_new_tokens=NEW_TOKENS, ignore_eos=True,
                                       block_size=8, **PENALTIES).generated_ids
    if world_size > 1 and split and vocab % 2:  # greedy without logprobs (ta.generate asks them): the fast path
        from treeattn.engine.client import Engine

        engine = Engine(model, block_size=8)  # joins the group; the other ranks serve until rank 0 closes it
        if engine.is_driver:
            with engine:
                results = engine.generate(_prompts(vocab), max_new_tokens=NEW_TOKENS, ignore_eos=True)
                gathers = engine.rank_measurements(reset=True)[0].comm["decode"]["by_op"]["allgather"]
                out["plain"] = [r.token_ids for r in results], gathers["calls"], gathers["payload_bytes"]
                # rank 0 alone reads a logit bias and penalties: its flag in the small gather asks for the full one
                results = engine.generate(_prompts(vocab), max_new_tokens=NEW_TOKENS, ignore_eos=True, **PENALTIES)
                gathers = engine.rank_measurements()[0].comm["decode"]["by_op"]["allgather"]
                out["penalized"] = [r.token_ids for r in results], gathers["calls"], gathers["payload_bytes"]
    return out


@pytest.mark.parametrize("vocab", [VOCAB_SPLIT_MIN_WEIGHTS // HIDDEN, VOCAB_SPLIT_MIN_WEIGHTS // HIDDEN + 3])
def test_split_projection_gives_the_one_process_tokens_and_logprobs(vocab):
    one = _generate(0, 1, vocab)
    two = ta.spawn(_generate, 2, vocab, timeout=300)
    unsplit = ta.spawn(_generate, 2, vocab, False, timeout=300)
    for name in ("greedy", "sampled"):
        assert two[0][name] == two[1][name], name  # every rank returns rank 0's ids and logprobs
        assert two[0][name][0] == unsplit[0][name][0] == one[name][0], name  # the tokens
        for reference in (unsplit[0], one):  # logprobs: the split's and another combine's rounding
            for ours, theirs in zip(two[0][name][1], reference[name][1]):
                assert ours == pytest.approx(theirs, abs=1e-5)
    assert unsplit[0]["by_op"]["allgather"] == 0
    # each decode step (both sequences together): one combine per layer (onepass) and the logits' all-gather
    steps = two[0]["steps"]
    assert steps == NEW_TOKENS - 1 and two[0]["by_op"]["allreduce"] == 2 * steps and two[0]["by_op"]["allgather"] == steps
    if vocab % 2:  # the odd vocabulary (a short last share) also runs the greedy fast path (_generate)
        tokens, calls, payload = two[0]["plain"]
        assert tokens == one["greedy"][0]  # the fast path's tokens
        # a gather a decode step of each share's maxima (<= 2 rows and the flag row, 3 float64 each), not its logits
        assert calls >= NEW_TOKENS - 1 and payload <= calls * 3 * 3 * 8
        tokens, calls, payload = two[0]["penalized"]
        assert tokens == one["penalized"] == [[7] * NEW_TOKENS] * 2  # rank 0 flags it, all gather the logits
        assert calls >= 2 * (NEW_TOKENS - 1) and payload > calls // 2 * 4 * (vocab // 2)


def test_below_the_threshold_rank_zero_projects_alone():
    from treeattn.engine.worker import runner

    assert runner.VOCAB_SPLIT_MIN_WEIGHTS == 1 << 22
    assert 4096 * 128 < runner.VOCAB_SPLIT_MIN_WEIGHTS  # the demo's model: no split, no extra round


def _gather_route(rank: int, world_size: int, vocab: int) -> tuple[str, bool]:
    from treeattn.engine.worker.runner import RankRunner

    torch.set_num_threads(1)
    runner = RankRunner(random_model(_config(vocab), seed=5), group=None, blocks_per_rank=4, block_size=8, decode="tree",
                        shared_memory=True)
    row = torch.zeros(1, -(-vocab // world_size))  # one decode row of this rank's share of the logits
    return type(runner.comm_group).__name__, runner.comm_group.fits(row)


def test_a_large_vocabularys_logits_gather_goes_through_shared_memory():
    # Gemma 3's 262,144 tokens: half the vocabulary is 512 KiB of float32 logits a row, twice the
    # shared-memory group's default capacity; the runner sizes its group for one row (gloo took 1.3 ms).
    from treeattn.parallel.shared_memory import DEFAULT_CAPACITY_BYTES

    vocab = 262_144
    assert 4 * (vocab // 2) > DEFAULT_CAPACITY_BYTES
    for route in ta.spawn(_gather_route, 2, vocab, timeout=300):
        assert route == ("SharedMemoryGroup", True)


def _full_row_tokens(logits: torch.Tensor) -> list[int | None]:
    """Today's path on the gathered logits: RankRunner._sample's finiteness check, then sample()'s greedy argmax."""
    from treeattn.engine.worker.runner import all_finite
    from treeattn.engine.worker.sampling import sample

    greedy, generator = ta.SamplingParams(temperature=0.0), torch.Generator().manual_seed(0)
    return [int(sample(row[None], greedy, generator)[0]) if all_finite(row) else None for row in logits]


def test_split_argmax_is_the_full_rows_argmax_on_crafted_shares():
    from treeattn.engine.worker.sampling import share_maxima, split_argmax

    g = torch.Generator().manual_seed(0)
    for vocab, ranks in ((12, 2), (13, 2), (13, 4), (9, 4), (10, 3), (7, 7), (31, 5)):  # (9, 4), (7, 7)...: short/empty
        share = -(-vocab // ranks)
        logits = torch.randint(-2, 3, (24, vocab), generator=g).float()  # few values: ties within and across shares
        logits[1] = 1.0  # every id ties: id 0
        logits[2, -1], logits[3, 0], logits[4, vocab // 2] = float("nan"), float("inf"), float("-inf")
        logits[5, -1] = 7.0  # the maximum in the last share alone
        logits[6, share - 1] = logits[6, share] = 7.0  # a tie across the first two shares: the smaller id
        logits[7, -1], logits[7, 0] = float("nan"), 9.0
        logits[8] = -1.0  # negatives throughout: a share's padding zeros must not win
        logits[9, 1] = -0.0
        maxima = torch.stack([share_maxima(logits[:, r * share : (r + 1) * share], r * share) for r in range(ranks)])
        assert split_argmax(maxima) == _full_row_tokens(logits), (vocab, ranks)


def test_greedy_tokens_example_runs():
    import doctest

    from treeattn.engine.worker import runner

    finder, examples = doctest.DocTestFinder(), doctest.DocTestRunner()
    for test in finder.find(runner.greedy_tokens, "greedy_tokens", globs={}):
        examples.run(test)
    assert (examples.failures, examples.tries) == (0, 4)


def test_verify_drafts_example_runs():
    import doctest

    from treeattn.engine.worker import runner

    finder, examples = doctest.DocTestFinder(), doctest.DocTestRunner()
    for test in finder.find(runner.verify_drafts, "verify_drafts", globs={}):
        examples.run(test)
    assert (examples.failures, examples.tries) == (0, 4)
