"""Which transformers versions and models treeattn.hf takes, with one clear error for the others."""

from __future__ import annotations

import inspect

import transformers
from packaging.version import Version

# The cache and attention interfaces this plug-in is written against: Cache.update(k, v, layer_idx)
# with per-layer CacheLayerMixin objects, AttentionInterface with sliding_window/softcap keywords,
# position ids passed to the attention functions. Tested with 5.23.
MIN_VERSION, MAX_VERSION = Version("5.0.0"), Version("6.0.0")

# Layer kinds whose attention is softmax attention over past tokens, causal, optionally windowed.
SUPPORTED_LAYER_TYPES = frozenset({"full_attention", "sliding_attention"})

# Architectures the tests check token for token (tests/test_hf.py); others that pass check_model
# use the same code path but are untested.
TESTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM",
                        "Gemma2ForCausalLM", "Phi3ForCausalLM", "Gemma3ForCausalLM")


def cache_keyword(model) -> str:
    """The keyword `model`'s forward and generate() take the KV cache by: "cache" in the transformers
    versions that renamed it (5.24 warns that "past_key_values" goes in 6.0), else "past_key_values"."""
    return "cache" if "cache" in inspect.signature(type(model).forward).parameters else "past_key_values"


def check_transformers_version(version: str | None = None) -> None:
    """Raise ImportError unless transformers' version is in [MIN_VERSION, MAX_VERSION)."""
    found = Version(version or transformers.__version__)
    if not (MIN_VERSION <= found < MAX_VERSION):
        raise ImportError(
            f"treeattn.hf needs transformers >= {MIN_VERSION}, < {MAX_VERSION} (its Cache and AttentionInterface API); "
            f"found transformers {found}"
        )


def check_model(model) -> None:
    """Raise ValueError naming the model class unless it is a decoder-only causal LM whose attention
    layers go through transformers' AttentionInterface and are all softmax attention layers."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    name = type(model).__name__
    config = getattr(model, "config", None)
    if config is None or not isinstance(model, transformers.PreTrainedModel):
        raise ValueError(f"model must be a transformers PreTrainedModel causal LM, got {name}")
    if getattr(config, "is_encoder_decoder", False):
        raise ValueError(f"{name} is an encoder-decoder model; treeattn.hf shards decoder-only causal LMs")
    if name not in set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values()) or not hasattr(model, "generate"):
        raise ValueError(
            f"{name} has no causal LM head (not an AutoModelForCausalLM class); load the checkpoint with "
            "AutoModelForCausalLM.from_pretrained"
        )
    if not getattr(model, "_supports_attention_backend", False):
        raise ValueError(
            f"{name} does not route its attention through transformers' AttentionInterface (or its attention is "
            "not softmax attention over a KV cache), so treeattn cannot shard it"
        )
    text = config.get_text_config()
    layer_types = getattr(text, "layer_types", None) or ()
    unsupported = sorted(set(layer_types) - SUPPORTED_LAYER_TYPES)
    if unsupported:
        raise ValueError(
            f"{name} has {unsupported} layers; treeattn shards only {sorted(SUPPORTED_LAYER_TYPES)} softmax attention layers"
        )
    if getattr(text, "use_bidirectional_attention", False):
        raise ValueError(f"{name} uses bidirectional attention; treeattn decodes causal models only")
