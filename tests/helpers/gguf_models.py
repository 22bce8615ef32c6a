"""Tiny random transformers models (Llama: untied; Qwen2: tied) of the GGUF tests' shapes.

    hf_model("llama")      # or "qwen2"; written to GGUF with gguf_files.write_gguf
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from gguf_files import VOCAB  # noqa: E402

COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              vocab_size=VOCAB, bos_token_id=1, eos_token_id=2, pad_token_id=None, initializer_range=0.1, rms_norm_eps=1e-5)


def hf_model(arch: str, seed: int = 0):
    torch.manual_seed(seed)
    if arch == "llama":
        config = transformers.LlamaConfig(**COMMON, tie_word_embeddings=False, rope_parameters={"rope_type": "default",
                                                                                                "rope_theta": 10000.0})
        return transformers.LlamaForCausalLM(config).eval()
    config = transformers.Qwen2Config(**COMMON, tie_word_embeddings=True, rope_parameters={"rope_type": "default",
                                                                                           "rope_theta": 1e6})
    return transformers.Qwen2ForCausalLM(config).eval()
