"""Tiny random-weight Llama-family checkpoints written by transformers, and treeattn's logits of a prompt.

    make_checkpoint("llama", directory)      # also "qwen2", "mistral"; returns the transformers model
    treeattn_logits(load_model(directory), ids)

Used by the model, loader, generation, CLI and speculation tests (transformers is the oracle).
"""

from __future__ import annotations

from pathlib import Path

import torch

from conftest import skip_unless_installed  # noqa: E402

skip_unless_installed("transformers")  # imported where used: the ranks that import this module need none of it

from treeattn.cache import ShardedKVCache  # noqa: E402
from treeattn.models import LocalAttention  # noqa: E402

VOCAB = 128
COMMON = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              vocab_size=VOCAB, bos_token_id=None, eos_token_id=None, pad_token_id=None, initializer_range=0.1)


ARCHS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(
        attention_bias=True,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 16})),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=True)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=8, head_dim=16)),
}


def make_checkpoint(arch: str, directory: Path, seed: int = 0, **save_kwargs):
    """Build a random-weight transformers model of `arch`, save it to `directory`; return the model."""
    import transformers

    config_cls, model_cls, extra = ARCHS[arch]
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**COMMON, **extra)).eval()
    model.save_pretrained(directory, **save_kwargs)
    return model


def treeattn_logits(model, ids: torch.Tensor) -> torch.Tensor:
    """All-position logits (1, S, V) of one prompt on one process, prefilled in one pass."""
    cfg = model.config
    cache = ShardedKVCache(num_layers=cfg.num_layers, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                           capacity=ids.shape[1], dtype=model.dtype)
    positions = torch.arange(ids.shape[1]).unsqueeze(0)
    slots = cache.extend(positions)
    with torch.inference_mode():
        return model.logits(model(ids, positions, cache.update(slots), LocalAttention()))


def _save_tokenizer(directory, *, swap: bool = False, special: tuple[str, ...] = ()) -> None:
    """A word-level tokenizer.json of VOCAB tokens t0..t{VOCAB-1} (swap: t1 and t2 trade ids; special:
    those tokens marked special)."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    vocab = {f"t{i}": i for i in range(VOCAB)}
    if swap:
        vocab["t1"], vocab["t2"] = 2, 1
    tokenizer = Tokenizer(WordLevel(vocab, unk_token="t0"))
    tokenizer.pre_tokenizer = Whitespace()
    tokenizer.add_special_tokens(list(special))
    tokenizer.save(str(directory / "tokenizer.json"))
