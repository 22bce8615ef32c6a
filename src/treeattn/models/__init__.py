"""Llama-family models (Llama, Qwen2, Mistral), DeepSeek-V2/V3 (MLA, MoE), Gemma 3 (text), their attention algorithms, and the
checkpoint loader."""

from treeattn.models.attention import (
    DECODE_KINDS,
    LocalAttention,
    RingDecodeAttention,
    TreeAttention,
    decode_attention,
)
from treeattn.models.deepseek import DeepseekConfig, DeepseekModel
from treeattn.models.gemma3 import Gemma3Config, Gemma3Model
from treeattn.models.llama import LlamaConfig, LlamaModel, random_model
from treeattn.models.loader import config_from_dict, load_model, load_tokenizer, read_config

__all__ = [
    "DECODE_KINDS",
    "DeepseekConfig",
    "DeepseekModel",
    "Gemma3Config",
    "Gemma3Model",
    "LlamaConfig",
    "LlamaModel",
    "LocalAttention",
    "RingDecodeAttention",
    "TreeAttention",
    "config_from_dict",
    "decode_attention",
    "load_model",
    "load_tokenizer",
    "random_model",
    "read_config",
]
