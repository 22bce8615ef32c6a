"""Which model class runs a parsed config: the one choice the loaders make (safetensors directories,
GGUF files, GGUF converted copies).

    model = model_class(config)(config, dtype=torch.float32, device="meta")

Imported by loader.py, gguf.py and gguf_cache.py; it imports the model modules only, so no loader
imports another to learn the class (gguf_cache and loader used to import each other).
"""

from __future__ import annotations

from treeattn.models.llama import LlamaModel


def model_class(config) -> type:
    """The model class of a parsed config: DeepseekModel for a DeepseekConfig, Gemma3Model for a
    Gemma3Config, else LlamaModel."""
    from treeattn.models.deepseek import DeepseekConfig, DeepseekModel
    from treeattn.models.gemma3 import Gemma3Config, Gemma3Model

    if isinstance(config, Gemma3Config):
        return Gemma3Model
    return DeepseekModel if isinstance(config, DeepseekConfig) else LlamaModel


__all__ = ["model_class"]
