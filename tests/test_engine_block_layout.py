"""A prompt's values do not depend on which physical blocks of the KV cache it gets.

The pool hands out free blocks first in, first out, so once requests have come and gone a later
request's blocks can wrap around the pool's end: logically consecutive, physically not. Until
session 24 a prefill chunk read such a sequence as one attention call per physically adjacent run
and merged the states, so its rounding depended on where the break fell: two prefills of one 8K
prompt in one engine differed by 1.2e-5 in a logprob (docs/engine.md, "Session 24 (logp24)"). Now a
sequence's blocks on a rank are one run, gathered when they are not adjacent (engine.worker.batch._runs),
and the same prompt gives the same bits in every request.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from helpers.llama_checkpoints import VOCAB, make_checkpoint  # noqa: E402

import treeattn as ta  # noqa: E402
from treeattn.engine.worker import batch  # noqa: E402

PROMPT = torch.randint(0, VOCAB, (300,), generator=torch.Generator().manual_seed(1)).tolist()  # 19 blocks of 16


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    directory = tmp_path_factory.mktemp("block_layout") / "llama"
    make_checkpoint("llama", directory)
    return directory


@pytest.mark.parametrize("copy_free_min_keys", [16, 10**6])  # read run by run; gathered into one batched call
def test_the_same_prompt_gives_the_same_bits_whatever_blocks_it_gets(checkpoint, monkeypatch, copy_free_min_keys):
    monkeypatch.setattr(batch, "COPY_FREE_MIN_KEYS", copy_free_min_keys)  # nproc=1: the rank runs in this process
    gathered = []  # per run read: whether its blocks were physically adjacent
    runs = batch._runs

    def recorded(*args):
        out = runs(*args)
        gathered.extend(not isinstance(where, int) for where, _, _ in out)
        return out

    monkeypatch.setattr(batch, "_runs", recorded)
    # a pool of 25 blocks: the second request's 19 blocks wrap around its end (blocks 19..24, then 0..)
    with ta.Engine(str(checkpoint), nproc=1, block_size=16, cache_tokens=25 * 16, prefix_cache=False, prefill_chunk=64,
                   threads_per_rank=1, max_context=320) as engine:
        results = [engine.generate(PROMPT, max_new_tokens=3, ignore_eos=True, prompt_logprobs=2, logprobs=2)
                   for _ in range(4)]
    first = results[0][0]
    for result, in results[1:]:
        assert result.token_ids == first.token_ids
        assert result.prompt_logprobs == first.prompt_logprobs  # float equality: the same bits
        assert result.logprobs == first.logprobs
    assert any(gathered) and not all(gathered)  # some request's blocks were split in the pool, some not
