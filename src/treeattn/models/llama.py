"""A Llama-family decoder in one readable file: Llama 2/3, Qwen2, Mistral.

RMSNorm, rotary position embeddings (including Llama 3 and linear rope scaling), grouped-query
attention, SwiGLU MLP, tied or untied embeddings, optional q/k/v bias (Qwen2) and a sliding window
(Mistral, Qwen2). The numerics follow Hugging Face transformers' implementation step by step (RMSNorm
in float32, RoPE angles in float32, rotate-half layout), so a checkpoint gives the same logits.

The model owns no cache and no attention algorithm. A forward pass gets two callables:

    kv_store(layer, k_new, v_new) -> (k, v, kv_pos)
        stores this pass's new keys/values of `layer` (RoPE applied) and returns what this rank
        attends to: k, v (B, Sk, Hkv, D), kv_pos int64 (B, Sk). treeattn.cache.CacheUpdate is one.
    attend(q, k, v, *, q_pos, kv_pos, window) -> out
        the attention itself: q (B, S, Hq, D) -> out (B, S, Hq, D). treeattn.models.attention has
        local (one device), tree (tree_decode), ring (ring_decode) and ring prefill (ring_attention).

`attend` is called in exactly one place (Attention.forward), so swapping the algorithm -- tree vs
ring decoding, or a shared-context (bifurcated) attention -- never touches the model.

Positions are absolute token indices, int64 (B, S); -1 marks a padding token (left padding of a
batch): it is rotated as position 0 and, as a query, sees no key.

Parameter names are those of the Hugging Face checkpoints without the leading "model."
(embed_tokens.weight, layers.0.self_attn.q_proj.weight, ..., norm.weight, lm_head.weight).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from treeattn.models.packed import fused_projections
from treeattn.ops.dense_linear import linear_float32
from treeattn.ops.rowwise import apply_rope_pair, rms_norm

KVStore = Callable[[int, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
AttendFn = Callable[..., torch.Tensor]

SUPPORTED_ROPE_TYPES = ("default", "llama3", "linear")


@dataclass
class LlamaConfig:
    """Hyperparameters of a Llama-family decoder (see treeattn.models.loader for reading config.json).

    Example::

        >>> import torch, treeattn as ta
        >>> config = ta.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
        ...                         num_kv_heads=2, head_dim=8)
        >>> config.num_heads // config.num_kv_heads, config.max_position_embeddings      # GQA groups, the default window
        (2, 4096)
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_type: str = "default"  # "default" | "llama3" | "linear"
    # factor, low_freq_factor, high_freq_factor, original_max_position_embeddings
    rope_scaling: dict = field(default_factory=dict)
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2: bias on q, k, v projections
    o_bias: bool = False  # Llama attention_bias=True: bias on o_proj too
    mlp_bias: bool = False
    layer_windows: tuple[int | None, ...] = ()  # sliding window per layer (None: full attention); () = all None
    max_position_embeddings: int = 4096
    architecture: str = "LlamaForCausalLM"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads", "head_dim"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if self.rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(f"rope_type must be one of {SUPPORTED_ROPE_TYPES}, got {self.rope_type!r}")
        check_norm_and_rope(self)
        if not self.layer_windows:
            self.layer_windows = (None,) * self.num_layers
        self.layer_windows = tuple(self.layer_windows)
        if len(self.layer_windows) != self.num_layers:
            raise ValueError(f"layer_windows must have num_layers={self.num_layers} entries, got {len(self.layer_windows)}")
        for w in self.layer_windows:
            if w is not None and (isinstance(w, bool) or not isinstance(w, int) or w < 1):
                raise ValueError(f"sliding window must be a positive int or None, got {w!r}")

    @property
    def cache_value_dim(self) -> None:
        """Values are stored beside the keys (treeattn.cache.ShardedKVCache's value_dim=None)."""
        return None

    @property
    def max_window(self) -> int | None:
        """The largest sliding window of any layer, None if some layer attends to everything."""
        if any(w is None for w in self.layer_windows):
            return None
        return max(self.layer_windows)


# rope_scaling entries that scale lengths or frequencies: they must be > 0 (the others only finite;
# e.g. YaRN's mscale may be 0).
POSITIVE_ROPE_SCALING = ("factor", "original_max_position_embeddings", "low_freq_factor", "high_freq_factor")


def config_reader(raw: dict, source: str, defaults: dict | None = None) -> Callable:
    """get(key, kind, default=...) over a Hugging Face config dict: raw[key] checked to be a `kind`
    (float takes ints too; a bool only where kind is bool), or where it is missing or null the given
    default, else defaults[key]; no value at all is a ValueError naming `source` and the key. The
    one key reader of the Llama, Gemma 3 and DeepSeek configs."""
    defaults = defaults or {}

    def get(key: str, kind: type, default=...):
        value = raw.get(key)
        if value is None:
            value = defaults.get(key) if default is ... else default
            if value is None and default is ...:
                raise ValueError(f"{source}: missing required key {key!r}")
            return value
        ok = isinstance(value, (int, float)) if kind is float else isinstance(value, kind)
        if not ok or (isinstance(value, bool) and kind is not bool):
            raise ValueError(f"{source}: key {key!r} must be {kind.__name__}, got {value!r}")
        return value

    return get


def check_norm_and_rope(config) -> None:
    """The numbers a NaN or a sign error in config.json would silently turn into NaN activations:
    rms_norm_eps and rope_theta finite and > 0, rope_scaling's numbers finite (lengths and factors
    > 0), max_position_embeddings a positive int. Raises ValueError naming the field."""
    numbers = [("rms_norm_eps", config.rms_norm_eps, True), ("rope_theta", config.rope_theta, True)]
    numbers += [(f"rope_scaling.{k}", v, k in POSITIVE_ROPE_SCALING) for k, v in config.rope_scaling.items()
                if isinstance(v, (int, float)) and not isinstance(v, bool)]
    for name, value, positive in numbers:
        if isinstance(value, bool) or not isinstance(value, (int,
                                                             float)) or not math.isfinite(value) or (positive and value <= 0):
            raise ValueError(f"{name} must be a finite {'positive ' if positive else ''}number, got {value!r}")
    limit = config.max_position_embeddings
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise ValueError(f"max_position_embeddings must be a positive int, got {limit!r}")


def rope_inverse_frequencies(config: LlamaConfig) -> torch.Tensor:
    """float32 (head_dim // 2,) inverse frequencies, with Llama 3 or linear scaling applied."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = config.rope_scaling
    if config.rope_type == "linear":
        return inv_freq / scaling["factor"]
    if config.rope_type == "llama3":
        factor = scaling["factor"]
        low_freq_factor = scaling["low_freq_factor"]
        high_freq_factor = scaling["high_freq_factor"]
        old_context = scaling["original_max_position_embeddings"]
        low_freq_wavelen = old_context / low_freq_factor
        high_freq_wavelen = old_context / high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        # Long wavelengths are stretched by `factor`, short ones kept, the band between interpolated.
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
        return torch.where(is_medium, smoothed, scaled)
    return inv_freq


def rope_cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin (B, S, head_dim) in `dtype` for int64 positions (B, S); padding (-1) is rotated as 0."""
    angles = positions.clamp(min=0)[..., None].float() * inv_freq.to(positions.device)  # float32 (B, S, D/2)
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, config: LlamaConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        self.window = config.layer_windows[layer]
        d, hd = config.hidden_size, config.head_dim
        self.q_proj = nn.Linear(d, config.num_heads * hd, bias=config.qkv_bias)
        self.k_proj = nn.Linear(d, config.num_kv_heads * hd, bias=config.qkv_bias)
        self.v_proj = nn.Linear(d, config.num_kv_heads * hd, bias=config.qkv_bias)
        self.o_proj = nn.Linear(config.num_heads * hd, d, bias=config.o_bias)

    def forward(self, x, positions, cos, sin, kv_store: KVStore, attend: AttendFn) -> torch.Tensor:
        B, S, _ = x.shape
        q, k, v = fused_projections(self, x, ("q_proj", "k_proj", "v_proj"))  # one packed matrix when fused (models.packed)
        q = q.view(B, S, self.num_heads, self.head_dim)
        k = k.view(B, S, self.num_kv_heads, self.head_dim)
        v = v.view(B, S, self.num_kv_heads, self.head_dim)
        q, k = self.queries_keys(q, k, cos, sin)
        k_all, v_all, kv_pos = kv_store(self.layer, k, v)
        out = attend(q, k_all, v_all, q_pos=positions, kv_pos=kv_pos, window=self.window)
        return self.o_proj(out.reshape(B, S, self.num_heads * self.head_dim))

    def queries_keys(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """The projected heads as the cache and attend() take them: rotated by their positions' angles.

        q: [B, S, Hq, D], k: [B, S, Hkv, D]; cos, sin: the rope tables of these positions. A family
        that normalises or scales the heads first (Gemma 3) overrides this, not forward."""
        return apply_rope_pair(q, k, cos, sin)  # one kernel call for both where it takes them


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        d, i = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(d, i, bias=config.mlp_bias)
        self.up_proj = nn.Linear(d, i, bias=config.mlp_bias)
        self.down_proj = nn.Linear(i, d, bias=config.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = fused_projections(self, x, ("gate_proj", "up_proj"))  # one packed matrix when fused (models.packed)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config: LlamaConfig, layer: int) -> None:
        super().__init__()
        self.self_attn = Attention(config, layer)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, h, positions, cos, sin, kv_store: KVStore, attend: AttendFn, chunk: int) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), positions, cos, sin, kv_store, attend)
        if h.shape[1] <= chunk:  # one chunk (a decode step): the same sum, without the slice and the loop
            h += self.mlp(self.post_attention_layernorm(h))
            return h
        # The MLP's intermediate activations are the largest of the layer: bound them to `chunk` tokens.
        for start in range(0, h.shape[1], chunk):
            part = h[:, start : start + chunk]
            part += self.mlp(self.post_attention_layernorm(part))
        return h


def embedding(num_embeddings: int, embedding_dim: int, device: torch.device | str) -> nn.Embedding:
    """nn.Embedding(num_embeddings, embedding_dim) on `device`; on "meta" (the loaders' skeleton)
    without its random init: reset_parameters' normal_ on "meta" runs a torch._refs decomposition whose
    first call imports torch._dynamo (about 2 s in every process that loads a model, every rank's
    included) for values the loader replaces anyway."""
    if torch.device(device).type == "meta":
        return nn.Embedding.from_pretrained(torch.empty(num_embeddings, embedding_dim, device="meta"), freeze=False)
    with torch.device(device):
        return nn.Embedding(num_embeddings, embedding_dim)


class LlamaModel(nn.Module):
    """A Llama-family causal language model.

    Args:
        config: LlamaConfig.
        dtype, device: of the parameters (device "meta" builds the skeleton the loader fills).

    Example (a random-weight model, one prompt through its KV cache on one process)::

        >>> import torch, treeattn as ta
        >>> config = ta.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
        ...                         num_kv_heads=2, head_dim=8)
        >>> from treeattn.models import LocalAttention
        >>> from treeattn.models.llama import random_model
        >>> model = random_model(config, seed=0)              # ta.LlamaModel(config) leaves the weights to load_state_dict
        >>> cache = ta.ShardedKVCache(num_layers=2, num_kv_heads=2, head_dim=8, capacity=16)
        >>> ids, positions = torch.tensor([[1, 2, 3, 4]]), torch.arange(4).unsqueeze(0)
        >>> with torch.inference_mode():
        ...     hidden = model(ids, positions, cache.update(cache.extend(positions)), LocalAttention())
        ...     logits = model.logits(hidden)
        >>> logits.shape                                       # (B, S, vocab)
        torch.Size([1, 4, 64])
    """

    # The layer and norm a family builds (treeattn.models.gemma3 sets its own).
    layer_class = DecoderLayer
    norm_class = RMSNorm

    def __init__(self, config: LlamaConfig, *, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> None:
        super().__init__()
        self.config = config
        with torch.device(device):
            self.embed_tokens = embedding(config.vocab_size, config.hidden_size, device)
            self.layers = nn.ModuleList(self.layer_class(config, i) for i in range(config.num_layers))
            self.norm = self.norm_class(config.hidden_size, config.rms_norm_eps)
            self.lm_head = None if config.tie_word_embeddings else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.to(dtype)
        # Set by treeattn.load_model from the checkpoint (None for random models): a
        # tokenizers.Tokenizer and a treeattn.models.chat.ChatTemplate, so chat messages can be
        # rendered to ids (treeattn.engine.generate takes them).
        self.tokenizer = None
        self.chat_template = None
        # float32 whatever the parameter dtype (a plain attribute, so module.to(dtype) leaves it alone)
        self.inv_freq = rope_inverse_frequencies(config)

    @property
    def dtype(self) -> torch.dtype:
        return self.norm.weight.dtype  # the embeddings may be kept packed (treeattn.models.packed)

    @property
    def device(self) -> torch.device:
        return self.norm.weight.device

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        kv_store: KVStore,
        attend: AttendFn,
        *,
        chunk: int = 1024,
    ) -> torch.Tensor:
        """Run S new tokens of every sequence through all layers, one layer at a time.

        Args:
            tokens: int64 (B, S) token ids.
            positions: int64 (B, S) absolute positions; -1 for padding.
            kv_store: stores each layer's new keys/values, returns what to attend to (see module doc).
            attend: the attention algorithm (see module doc).
            chunk: MLP activations are computed `chunk` tokens at a time.

        Returns:
            (B, S, hidden_size) final hidden states after the last RMSNorm, in the model dtype;
            logits() turns the rows you need into logits.
        """
        h = self.embed_tokens(tokens).to(self.dtype)  # a packed table gives float32 rows
        if self.inv_freq.device != h.device:  # a plain attribute does not follow module.to(device): move it once
            self.inv_freq = self.inv_freq.to(h.device)
        cos, sin = rope_cos_sin(self.inv_freq, positions, h.dtype)
        for layer in self.layers:
            h = layer(h, positions, cos, sin, kv_store, attend, chunk)
        return self.norm(h)

    def logits(self, hidden: torch.Tensor, vocab: slice | None = None, weight: torch.Tensor | None = None) -> torch.Tensor:
        """(..., hidden_size) final hidden states -> (..., vocab_size) float32 logits; with `vocab`
        (a slice of token ids, step 1) only those columns, (..., len(range(vocab_size)[vocab])), the
        same values as the full call's (each logit is its own dot product). `weight`: a packed output
        projection's float32 dequantization held by the caller (prompt logprobs: made once for many
        calls; a plain tensor or one prepacked by ops.dense_linear.prepack_float32), multiplied in float32 by
        ops.dense_linear.linear_float32 (MKL's sgemm or oneDNN's matmul on the CPU, the faster on its vendor), as the
        packed layer multiplies more than MAX_KERNEL_ROWS rows."""
        head = self.embed_tokens if self.lm_head is None else self.lm_head
        if weight is not None:
            out = linear_float32(hidden.to(weight.dtype), weight if vocab is None else weight[vocab])
            return out.to(hidden.dtype).float()
        if isinstance(head, (nn.Embedding, nn.Linear)):
            return F.linear(hidden, head.weight if vocab is None else head.weight[vocab]).float()
        return head.project(hidden, vocab).float()  # kept packed (treeattn.models.packed)


def random_model(config: LlamaConfig, *, seed: int = 0, dtype: torch.dtype = torch.float32, std: float = 0.02) -> LlamaModel:
    """A model with reproducible random weights (normal(0, std), norms at 1): the same on every rank
    for the same seed. For demos and tests that need no download."""
    model = LlamaModel(config, dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("layernorm.weight") or name == "norm.weight":
                param.fill_(1.0)
            else:
                param.normal_(0.0, std, generator=generator)
    return model.to(dtype)
