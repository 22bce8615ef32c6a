"""Gemma 3 (text) in one readable file: sliding-window and global layers, QK-norm, four norms a layer.

What differs from the Llama family (treeattn.models.llama), step by step as in Hugging Face
transformers' Gemma3ForCausalLM, so that a checkpoint gives the same logits:

- RMSNorm scales by (1 + weight), in float32, and casts after the scaling (Gemma3RMSNorm).
- The token embeddings are multiplied by sqrt(hidden_size), a scalar in the parameter dtype.
- Each layer: h += post_attention_norm(attn(input_norm(h))); h += post_feedforward_norm(mlp(pre_feedforward_norm(h))).
- Attention RMS-normalizes every query and key head (q_norm, k_norm over head_dim) before RoPE,
  and scales scores by query_pre_attn_scalar ** -0.5 instead of head_dim ** -0.5.
- Two kinds of layers (config.layer_windows): sliding-window layers (window W, RoPE base
  rope_local_theta, default RoPE) and global layers (None; RoPE base rope_theta with the config's
  scaling). Gemma 3 has five window layers per global one.
- The MLP is gelu-tanh gated: down(gelu_tanh(gate(x)) * up(x)).
- Optional final logit soft-capping: logits = c * tanh(logits / c).

The model keeps LlamaModel's interface (forward(tokens, positions, kv_store, attend), logits()),
so the engine, generate() and the caches run it unchanged. Attention logit soft-capping
(Gemma 2) is not supported: Gemma 3 has none, and a config that sets it is refused.

Parameter names are those of Hugging Face's Gemma3ForCausalLM without the leading "model."
(layers.0.self_attn.q_norm.weight, layers.0.pre_feedforward_layernorm.weight, ...).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from treeattn.models.llama import (MLP, AttendFn, Attention, KVStore, LlamaConfig, LlamaModel, config_reader, rope_cos_sin,
                                   rope_inverse_frequencies)
from treeattn.models.packed import fused_projections
from treeattn.ops.rowwise import rms_norm

ARCHITECTURE = "Gemma3ForCausalLM"


@dataclass
class Gemma3Config(LlamaConfig):
    """A LlamaConfig with Gemma 3's own fields.

    layer_windows says which layers slide (an int W) and which are global (None); rope_theta,
    rope_type and rope_scaling are the global layers' RoPE, rope_local_theta the window layers'
    (always default RoPE).
    """

    query_pre_attn_scalar: float = 256.0
    rope_local_theta: float = 10000.0
    final_logit_softcapping: float | None = None
    architecture: str = ARCHITECTURE
    checkpoint_architecture: str = ARCHITECTURE  # the checkpoint's: Gemma3ForConditionalGeneration names weights differently

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("query_pre_attn_scalar", "rope_local_theta"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"{name} must be a finite positive number, got {value!r}")
        cap = self.final_logit_softcapping
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, (int, float)) or not math.isfinite(cap) or cap <= 0):
            raise ValueError(f"final_logit_softcapping must be None or a finite positive number, got {cap!r}")

    @property
    def window_layers(self) -> tuple[int, ...]:
        """Indices of the sliding-window layers."""
        return tuple(i for i, w in enumerate(self.layer_windows) if w is not None)

    @property
    def global_layers(self) -> tuple[int, ...]:
        """Indices of the layers that attend to every earlier position."""
        return tuple(i for i, w in enumerate(self.layer_windows) if w is None)


def local_rope_config(config: Gemma3Config) -> LlamaConfig:
    """The RoPE of the window layers as a LlamaConfig (base rope_local_theta, no scaling)."""
    return LlamaConfig(vocab_size=1, hidden_size=1, intermediate_size=1, num_layers=1, num_heads=1, num_kv_heads=1,
                       head_dim=config.head_dim, rope_theta=float(config.rope_local_theta))


class Gemma3RMSNorm(nn.Module):
    """x / rms(x) * (1 + weight), computed in float32 and cast back to x's dtype at the end.

    A float32 x goes through treeattn.ops.rowwise.rms_norm with weight_offset=1: the same formula,
    and one compiled call for a decode step's rows instead of seven torch calls (six norms a layer
    made 8% of a Gemma 3 270M decode step)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == self.weight.dtype == torch.float32:
            return rms_norm(x, self.weight, self.eps, weight_offset=1.0)
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * (1.0 + self.weight.float())).to(x.dtype)


class Gemma3Attention(Attention):
    """Llama's attention (projections, cache, attend, output) with Gemma 3's heads: an RMS norm on
    each query and key head before the rotation, and query_pre_attn_scalar's scale on the queries."""

    def __init__(self, config: Gemma3Config, layer: int) -> None:
        super().__init__(config, layer)
        hd = config.head_dim
        self.q_norm = Gemma3RMSNorm(hd, config.rms_norm_eps)
        self.k_norm = Gemma3RMSNorm(hd, config.rms_norm_eps)
        # attend() scales scores by head_dim ** -0.5; the queries carry the rest of Gemma's scale.
        ratio = (config.query_pre_attn_scalar ** -0.5) / (hd ** -0.5)
        self.query_factor = None if ratio == 1.0 else ratio

    def queries_keys(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        q, k = super().queries_keys(self.q_norm(q), self.k_norm(k), cos, sin)
        return (q if self.query_factor is None else q * self.query_factor), k


class Gemma3MLP(MLP):
    """Llama's gated MLP (the same projections) with GELU (tanh approximation): down(gelu_tanh(gate(x)) * up(x))."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = fused_projections(self, x, ("gate_proj", "up_proj"))  # one packed matrix when fused (models.packed)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, config: Gemma3Config, layer: int) -> None:
        super().__init__()
        self.self_attn = Gemma3Attention(config, layer)
        self.mlp = Gemma3MLP(config)
        d, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = Gemma3RMSNorm(d, eps)
        self.post_attention_layernorm = Gemma3RMSNorm(d, eps)
        self.pre_feedforward_layernorm = Gemma3RMSNorm(d, eps)
        self.post_feedforward_layernorm = Gemma3RMSNorm(d, eps)

    def forward(self, h, positions, cos, sin, kv_store: KVStore, attend: AttendFn, chunk: int) -> torch.Tensor:
        h = h + self.post_attention_layernorm(self.self_attn(self.input_layernorm(h), positions, cos, sin, kv_store, attend))
        if h.shape[1] <= chunk:  # one chunk (a decode step): the same sum, without the slice and the loop
            h += self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))
            return h
        # The MLP's intermediate activations are the largest of the layer: bound them to `chunk` tokens.
        for start in range(0, h.shape[1], chunk):
            part = h[:, start : start + chunk]
            part += self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(part)))
        return h


class Gemma3Model(LlamaModel):
    """Gemma 3's text decoder (see the module docstring); LlamaModel's interface.

    Args:
        config: Gemma3Config.
        dtype, device: of the parameters (device "meta" builds the skeleton the loader fills).
    """

    layer_class = Gemma3DecoderLayer
    norm_class = Gemma3RMSNorm

    def __init__(self, config: Gemma3Config, *, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> None:
        if not isinstance(config, Gemma3Config):
            raise TypeError(f"config must be a Gemma3Config, got {type(config).__name__}")
        super().__init__(config, dtype=dtype, device=device)
        # float32 (head_dim // 2,) inverse frequencies of the window layers (self.inv_freq: the global ones)
        self.inv_freq_local = rope_inverse_frequencies(local_rope_config(config))

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, kv_store: KVStore, attend: AttendFn, *,
                chunk: int = 1024) -> torch.Tensor:
        """As LlamaModel.forward: tokens, positions int64 (B, S) -> (B, S, hidden_size) final hidden
        states (after the last norm) in the model dtype."""
        h = self.embed_tokens(tokens).to(self.dtype)  # a packed table gives float32 rows
        h = h * torch.tensor(self.config.hidden_size ** 0.5, dtype=h.dtype, device=h.device)
        if self.inv_freq.device != h.device:  # plain attributes do not follow module.to(device): move them once
            self.inv_freq, self.inv_freq_local = self.inv_freq.to(h.device), self.inv_freq_local.to(h.device)
        rope = {None: rope_cos_sin(self.inv_freq, positions, h.dtype)}
        if self.config.window_layers:
            rope["local"] = rope_cos_sin(self.inv_freq_local, positions, h.dtype)
        for layer in self.layers:
            cos, sin = rope[None if layer.self_attn.window is None else "local"]
            h = layer(h, positions, cos, sin, kv_store, attend, chunk)
        return self.norm(h)

    def logits(self, hidden: torch.Tensor, vocab: slice | None = None, weight: torch.Tensor | None = None) -> torch.Tensor:
        """(..., hidden_size) final hidden states -> (..., vocab_size) float32 logits (the columns of
        `vocab` only, `weight` as LlamaModel.logits), soft-capped when the config says so."""
        logits = super().logits(hidden, vocab, weight)
        cap = self.config.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap


def gemma3_layer_windows(num_layers: int, window: int, pattern: int = 6) -> tuple[int | None, ...]:
    """Gemma 3's default layout: every `pattern`-th layer (1-based) global, the others windowed."""
    return tuple(None if (i + 1) % pattern == 0 else window for i in range(num_layers))


# transformers' Gemma3TextConfig defaults: a saved config omits the keys that keep them (a gemma3
# checkpoint's text_config in particular).
TEXT_DEFAULTS = {
    "vocab_size": 262208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26, "num_attention_heads": 8,
    "num_key_value_heads": 4, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-6, "bos_token_id": 2, "eos_token_id": 1, "tie_word_embeddings": True, "attention_bias": False,
    "query_pre_attn_scalar": 256, "sliding_window": 4096, "sliding_window_pattern": 6,
}
DEFAULT_ROPE_THETA = {"full_attention": 1_000_000.0, "sliding_attention": 10_000.0}
# config.json "architectures" / "model_type" -> how the text model's config and weights are found
HF_ARCHITECTURES = {"Gemma3ForCausalLM": "gemma3_text", "Gemma3ForConditionalGeneration": "gemma3"}
# Weight-name prefixes of the text model inside a gemma3 (image-text) checkpoint (transformers 5, then 4),
# and the parts of it that are not the text model.
MULTIMODAL_TEXT_PREFIXES = ("model.language_model.", "language_model.model.", "language_model.")
MULTIMODAL_OTHER_PREFIXES = ("model.vision_tower.", "model.multi_modal_projector.", "vision_tower.", "multi_modal_projector.")


def config_from_dict(raw: dict, architecture: str, *, source: str = "config.json") -> Gemma3Config:
    """A Gemma3Config from a Hugging Face config dict: model_type gemma3_text (Gemma3ForCausalLM), or
    gemma3 (Gemma3ForConditionalGeneration), whose text model is described by text_config; the keys
    a config omits take transformers' defaults. Errors name `source` and the key."""
    if architecture == "Gemma3ForConditionalGeneration":
        text = raw.get("text_config")
        if not isinstance(text, dict):
            raise ValueError(f"{source}: a gemma3 (image-text) config needs a 'text_config' object, got {text!r}")
        raw, source = text, f"{source} text_config"

    get = config_reader(raw, source, TEXT_DEFAULTS)

    if get("hidden_activation", str) not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ValueError(
            f"{source}: unsupported hidden_activation {raw['hidden_activation']!r}; Gemma 3 uses 'gelu_pytorch_tanh'"
        )
    if get("attn_logit_softcapping", float, None) is not None:
        raise ValueError(
            f"{source}: attn_logit_softcapping={raw['attn_logit_softcapping']!r} is not supported (Gemma 3 has none)"
        )
    if get("use_bidirectional_attention", bool, False):
        raise ValueError(f"{source}: use_bidirectional_attention=true is not supported (a causal decoder only)")
    layers = get("num_hidden_layers", int)
    window = get("sliding_window", int)
    types = raw.get("layer_types")
    if types is None:
        pattern = get("sliding_window_pattern", int,
                      raw.get("_sliding_window_pattern") or TEXT_DEFAULTS["sliding_window_pattern"])
        windows = gemma3_layer_windows(layers, window, pattern)
    else:
        if not isinstance(types, list) or len(types) != layers or not set(types) <= {"sliding_attention", "full_attention"}:
            raise ValueError(f"{source}: 'layer_types' must list {layers} of 'sliding_attention' / 'full_attention', got "
                             f"{types!r}")
        windows = tuple(window if t == "sliding_attention" else None for t in types)
    rope = _rope_parameters(raw, source)
    global_rope = rope["full_attention"]
    rope_type = global_rope.get("rope_type", global_rope.get("type", "default"))
    scaling = {k: v for k, v in global_rope.items() if k not in ("rope_type", "type", "rope_theta")}
    local_type = rope["sliding_attention"].get("rope_type", "default")
    if local_type != "default":
        raise ValueError(f"{source}: the window layers' rope type {local_type!r} is not supported (only 'default')")
    eos = raw.get("eos_token_id", TEXT_DEFAULTS["eos_token_id"])
    eos = eos if isinstance(eos, list) else [eos]
    if not all(isinstance(e, int) and not isinstance(e, bool) for e in eos):
        raise ValueError(f"{source}: 'eos_token_id' must be a token id or a list of them, got {raw.get('eos_token_id')!r}")
    hidden, heads = get("hidden_size", int), get("num_attention_heads", int)
    try:
        return Gemma3Config(
            vocab_size=get("vocab_size", int),
            hidden_size=hidden,
            intermediate_size=get("intermediate_size", int),
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=get("num_key_value_heads", int),
            head_dim=get("head_dim", int),
            rms_norm_eps=float(get("rms_norm_eps", float)),
            rope_theta=float(global_rope.get("rope_theta", DEFAULT_ROPE_THETA["full_attention"])),
            rope_type=rope_type,
            rope_scaling=scaling,
            tie_word_embeddings=get("tie_word_embeddings", bool),
            qkv_bias=get("attention_bias", bool),
            o_bias=get("attention_bias", bool),
            layer_windows=windows,
            max_position_embeddings=get("max_position_embeddings", int),
            bos_token_id=get("bos_token_id", int),
            eos_token_ids=tuple(eos),
            query_pre_attn_scalar=float(get("query_pre_attn_scalar", float)),
            rope_local_theta=float(rope["sliding_attention"].get("rope_theta", DEFAULT_ROPE_THETA["sliding_attention"])),
            final_logit_softcapping=get("final_logit_softcapping", float, None),
            checkpoint_architecture=architecture,
        )
    except (ValueError, TypeError) as exc:
        raise ValueError(f"{source}: {exc}") from exc


def _rope_parameters(raw: dict, source: str) -> dict[str, dict]:
    """{"full_attention": {...}, "sliding_attention": {...}} from transformers 5's rope_parameters
    (per layer type), or transformers 4's rope_theta, rope_local_base_freq and rope_scaling (the
    global layers')."""
    params = raw.get("rope_parameters")
    if params is not None:
        if not isinstance(params, dict):
            raise ValueError(f"{source}: key 'rope_parameters' must be an object, got {params!r}")
        if "full_attention" in params or "sliding_attention" in params:
            out = {k: dict(params.get(k) or {}) for k in DEFAULT_ROPE_THETA}
        else:  # one set for the global layers
            out = {"full_attention": dict(params), "sliding_attention": {}}
    else:
        scaling = raw.get("rope_scaling") or {}
        if not isinstance(scaling, dict):
            raise ValueError(f"{source}: key 'rope_scaling' must be an object, got {scaling!r}")
        out = {"full_attention": dict(scaling), "sliding_attention": {}}
        if raw.get("rope_theta") is not None:
            out["full_attention"]["rope_theta"] = raw["rope_theta"]
        if raw.get("rope_local_base_freq") is not None:
            out["sliding_attention"]["rope_theta"] = raw["rope_local_base_freq"]
    for kind, values in out.items():
        theta = values.get("rope_theta", DEFAULT_ROPE_THETA[kind])
        if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not math.isfinite(theta) or theta <= 0:
            raise ValueError(f"{source}: the {kind} layers' rope_theta must be a finite positive number, got {theta!r}")
    return out


def checkpoint_name(name: str, architecture: str) -> str | None:
    """Our parameter name for a checkpoint tensor of a Gemma 3 `architecture`, None for a tensor
    that is not the text model's (a gemma3 checkpoint's vision tower and projector)."""
    if architecture == "Gemma3ForConditionalGeneration":
        if name.startswith(MULTIMODAL_OTHER_PREFIXES):
            return None
        for prefix in MULTIMODAL_TEXT_PREFIXES:
            if name.startswith(prefix):
                return name[len(prefix):]
    return name[len("model."):] if name.startswith("model.") else name


def random_gemma3(config: Gemma3Config, *, seed: int = 0, dtype: torch.dtype = torch.float32, std: float = 0.02) -> Gemma3Model:
    """A Gemma3Model with reproducible random weights (normal(0, std); norm weights normal(0, 0.1),
    so that (1 + weight) is near 1): the same on every rank for the same seed."""
    model = Gemma3Model(config, dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.normal_(0.0, 0.1 if name.endswith("norm.weight") else std, generator=generator)
    return model.to(dtype)


__all__ = ["ARCHITECTURE", "Gemma3Config", "Gemma3Model", "checkpoint_name", "config_from_dict", "gemma3_layer_windows",
           "random_gemma3"]
