"""The output projection split over CPU ranks by vocabulary (engine.worker.runner: VOCAB_SPLIT_MIN_WEIGHTS).

A model whose vocab_size x hidden_size reaches the threshold has each of 2 real gloo ranks compute
the logits of its half of the vocabulary, all-gathered to rank 0: the tokens (greedy and sampled, a
batch of two prompts) are those of 2 ranks without the split and of the one-process engine, the
log-probabilities theirs within float32 rounding (each logit is the same dot product, but a BLAS may
sum it in another order for a matrix of half the rows: not the same bits on every host, issue 46); the decode steps count the
gather's round. An odd vocabulary pads the last rank's share.
"""

from __future__ import annotations

import pytest
import torch

import treeattn as ta
from treeattn.engine.worker.runner import VOCAB_SPLIT_MIN_WEIGHTS
from treeattn.models.llama import random_model

HIDDEN = 64
NEW_TOKENS = 6


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
