"""Per-token log-probabilities from ta.Engine (SamplingParams.logprobs).

Every generated token's logprob and its top-k alternatives equal the float64 log-softmax of
transformers' uncached forward over the prompt and the tokens before it, on one in-process rank
and on 2 spawned ranks (tree decoding over the sharded cache), with and without prompt-lookup
speculation (tokens accepted from a draft get the logprob of the row that verified them), greedy
and sampled. Requests that ask for none carry none; bad values are refused naming the field.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from helpers.llama_checkpoints import VOCAB, make_checkpoint  # noqa: E402

import treeattn as ta  # noqa: E402
from treeattn.engine import SamplingParams  # noqa: E402

_G = torch.Generator().manual_seed(11)
_PATTERN = torch.randint(0, VOCAB, (6,), generator=_G).tolist()
# Repeats, so that prompt lookup drafts (and some drafts are accepted).
PROMPT = _PATTERN + torch.randint(0, VOCAB, (3,), generator=_G).tolist() + _PATTERN * 2
NEW_TOKENS = 10
TOP = 3


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    directory = tmp_path_factory.mktemp("logprobs") / "llama"
    hf = make_checkpoint("llama", directory)
    return directory, hf.double().eval()


def _expected(hf, prompt: list[int], generated: list[int]) -> torch.Tensor:
    """float64 (len(generated), V): log-softmax of the uncached forward at each generated token's row."""
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + generated[:-1]])).logits[0, len(prompt) - 1 :]
    return torch.log_softmax(logits, dim=-1)


def _check(result, hf, prompt) -> None:
    assert len(result.logprobs) == len(result.token_ids) == NEW_TOKENS
    expected = _expected(hf, prompt, result.token_ids)
    for row, token, entry in zip(expected, result.token_ids, result.logprobs):
        assert entry.logprob == pytest.approx(float(row[token]), abs=1e-4)
        top_values, top_ids = row.topk(TOP)
        assert [a for a, _ in entry.top] == top_ids.tolist()
        assert [lp for _, lp in entry.top] == pytest.approx(top_values.tolist(), abs=1e-4)


@pytest.mark.parametrize("nproc, speculate", [(1, None), (2, "ngram")])
def test_logprobs_equal_the_models_log_softmax(checkpoint, nproc, speculate):
    directory, hf = checkpoint
    with ta.Engine(str(directory), nproc=nproc, block_size=4, cache_tokens=256, speculate=speculate,
                   threads_per_rank=1) as engine:
        greedy, = engine.generate(PROMPT, max_new_tokens=NEW_TOKENS, ignore_eos=True, logprobs=TOP)
        sampled, = engine.generate(PROMPT, max_new_tokens=NEW_TOKENS, ignore_eos=True, logprobs=TOP, temperature=0.9, seed=4)
        plain, = engine.generate(PROMPT, max_new_tokens=NEW_TOKENS, ignore_eos=True)
        events = list(engine.stream(PROMPT, max_new_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0))
        if speculate:
            assert greedy.speculation["accepted"] > 0  # some tokens came from verified drafts
    _check(greedy, hf, PROMPT)
    _check(sampled, hf, PROMPT)
    assert plain.logprobs is None and plain.token_ids == greedy.token_ids
    # (the stream reuses the cached prompt: another batch shape, so equal up to rounding)
    assert [e.logprob.logprob for e in events] == pytest.approx([e.logprob for e in greedy.logprobs], abs=1e-5)
    assert all(e.logprob.top == () for e in events)


@pytest.mark.parametrize("value", [-1, 21, 2.5, True, "3"])
def test_bad_logprobs_are_refused_naming_the_field(value):
    with pytest.raises(ValueError, match="^logprobs must be None or an int in \\[0, 20\\], got"):
        SamplingParams(logprobs=value)
