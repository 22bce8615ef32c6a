"""DeepSeek-V2 / V3: multi-head latent attention (MLA) over a latent KV cache, and MoE MLPs.

The numerics follow transformers' DeepseekV2 / DeepseekV3 modeling files step by step (RMSNorm in
float32, RoPE angles in float32, YaRN scaling with its mscale, the routers in float32), so a
checkpoint gives the same logits. Parameter names are the checkpoint's without the leading
"model." (routed experts as layers.L.mlp.experts.E.{gate,up,down}_proj.weight, as save_pretrained
writes them).

MLA. Per token and layer the cache holds one entry of kv_lora_rank + qk_rope_head_dim numbers:

    entry = [ c (kv_lora_rank): RMSNorm(x W_DKV), the compressed latent | k_rope (qk_rope_head_dim) ]

which the model hands to kv_store as ONE key head (Hkv = 1, D = kv_lora_rank + qk_rope_head_dim)
whose first kv_lora_rank channels are also the value (Dv = kv_lora_rank): a cache built with
value_dim=kv_lora_rank stores no separate V (treeattn.cache.ShardedKVCache). Per head h, the
up-projection kv_b_proj splits into W_UK[h] (qk_nope_head_dim x kv_lora_rank) and W_UV[h]
(v_head_dim x kv_lora_rank). Attention then runs in one of two forms, which give the same result:

- absorbed: q_nope[h] is projected into the latent space (q_nope[h] W_UK[h]), concatenated with
  q_rope[h], and attends to the entries directly: multi-query attention with Hkv = 1, D = 576,
  Dv = 512 at DeepSeek-V3's sizes. The per-head output, a mix of latents, goes out through W_UV[h].
  Nothing per-head is ever built from the cache, so a decode step reads exactly the cache. This is
  what makes the sharded decode cheap: tree_decode merges (out, lse) of width kv_lora_rank.
- naive: the rank's shard is decompressed into per-head keys [c W_UK[h]^T, k_rope] and values
  c W_UV[h]^T, and q = [q_nope, q_rope] attends to them (MHA with D = qk_nope + qk_rope, Dv =
  v_head_dim). Fewer flops per (query, key) pair, so faster for long query blocks (prefill).

DeepseekModel.attention_form chooses: "auto", "absorbed" or "naive". "auto" runs the naive form
only for a block of several queries attended on one device (attend.name == "local") where it
costs fewer flops (prefers_naive), and the absorbed form everywhere else. Across ranks every rank
must take the same form (the attention is a collective) while the shard sizes the choice would
read differ per rank; and there the absorbed form is the one that moves least: ring prefill
passes latent entries (576 + 512 numbers per token at V3 sizes) instead of decompressed per-head
keys and values (128 x (192 + 128)). The naive form needs the shard as one tensor; kv_stores that
hand over anything else (the engine's per-group shards, shared-context splits) run absorbed. The attention functions take no
softmax scale: q is pre-multiplied by
softmax_scale / D ** -0.5, so the default D ** -0.5 of the kernels gives softmax_scale.

MoE (layers >= first_k_dense_replace): routed experts weighted by a router plus always-on shared
experts. V3's router: sigmoid scores, e_score_correction_bias added for the choice only,
group-limited top-k (the n_group groups ranked by the sum of their two best scores, topk_group
kept), weights = the chosen experts' sigmoid scores, normalized if norm_topk_prob, times
routed_scaling_factor. V2's router: softmax scores, top-k ("greedy") or group-limited by each
group's best score ("group_limited_greedy"), times routed_scaling_factor.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from treeattn.models.llama import AttendFn, KVStore, RMSNorm, check_norm_and_rope, config_reader, embedding
from treeattn.ops.dense_linear import linear_float32

ATTENTION_FORMS = ("auto", "absorbed", "naive")
SUPPORTED_ROPE_TYPES = ("default", "yarn")
ROUTERS = ("v3", "greedy", "group_limited_greedy")  # V3's noaux_tc; V2's two topk_methods
# q_a_layernorm and kv_a_layernorm are built without the config's eps in transformers (default 1e-6).
LATENT_NORM_EPS = 1e-6


@dataclass
class DeepseekConfig:
    """Hyperparameters of a DeepSeek-V2/V3 decoder (treeattn.models.deepseek.config_from_dict reads config.json).

    The cache layout the generation code reads: num_layers, num_kv_heads (1), head_dim
    (kv_lora_rank + qk_rope_head_dim) and cache_value_dim (kv_lora_rank: the values are the first
    kv_lora_rank channels of the keys).
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    kv_lora_rank: int
    q_lora_rank: int | None
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    moe_intermediate_size: int = 0
    n_routed_experts: int = 0  # 0: every layer dense
    n_shared_experts: int = 0
    num_experts_per_tok: int = 0
    first_k_dense_replace: int = 0
    router: str = "v3"  # one of ROUTERS
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    norm_topk_prob: bool = False
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_type: str = "default"  # "default" | "yarn"
    # yarn: factor, original_max_position_embeddings, beta_fast/slow, mscale, mscale_all_dim, attention_factor, truncate
    rope_scaling: dict = field(default_factory=dict)
    rope_interleave: bool = True  # rotate pairs (x0, x1), (x2, x3), ... (V2 always; V3's default)
    attention_bias: bool = False
    mlp_bias: bool = False
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 4096
    num_mtp_layers: int = 0  # V3's multi-token-prediction layers: in the checkpoint, not used here
    architecture: str = "DeepseekV3ForCausalLM"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        positive = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "kv_lora_rank",
                    "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "max_position_embeddings")
        for name in positive:
            _check_int(name, getattr(self, name), 1)
        if self.q_lora_rank is not None:
            _check_int("q_lora_rank", self.q_lora_rank, 1)
        for name in ("n_routed_experts", "n_shared_experts", "first_k_dense_replace", "num_mtp_layers"):
            _check_int(name, getattr(self, name), 0)
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim must be even for rotary embeddings, got {self.qk_rope_head_dim}")
        if self.router not in ROUTERS:
            raise ValueError(f"router must be one of {ROUTERS}, got {self.router!r}")
        if self.rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(f"rope_type must be one of {SUPPORTED_ROPE_TYPES}, got {self.rope_type!r}")
        check_norm_and_rope(self)
        if self.has_moe:
            _check_int("moe_intermediate_size", self.moe_intermediate_size, 1)
            _check_int("num_experts_per_tok", self.num_experts_per_tok, 1)
            if self.num_experts_per_tok > self.n_routed_experts:
                raise ValueError(f"num_experts_per_tok ({self.num_experts_per_tok}) exceeds n_routed_experts "
                                 f"({self.n_routed_experts})")
            if self.router != "greedy":
                _check_int("n_group", self.n_group, 1)
                _check_int("topk_group", self.topk_group, 1)
                if self.n_routed_experts % self.n_group:
                    raise ValueError(f"n_routed_experts ({self.n_routed_experts}) must be a multiple of n_group ({self.n_group})")
                if self.topk_group > self.n_group:
                    raise ValueError(f"topk_group ({self.topk_group}) exceeds n_group ({self.n_group})")
                if self.router == "v3" and self.n_routed_experts // self.n_group < 2:
                    raise ValueError(f"the V3 router ranks groups by their two best experts: n_routed_experts / n_group must be "
                                     f">= 2, "
                                     f"got {self.n_routed_experts} / {self.n_group}")
        for name, value in [("rms_norm_eps", self.rms_norm_eps), ("rope_theta", self.rope_theta),
                            ("routed_scaling_factor", self.routed_scaling_factor)]:
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a finite positive number, got {value!r}")

    # ------------------------------------------------------------- what the generation code reads
    @property
    def num_kv_heads(self) -> int:
        """Key heads of the cache: one latent entry per token (multi-query)."""
        return 1

    @property
    def head_dim(self) -> int:
        """Channels of one cache entry: the latent, then the RoPE key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def cache_value_dim(self) -> int:
        """The values are the first kv_lora_rank channels of each cache entry (no separate V)."""
        return self.kv_lora_rank

    @property
    def layer_windows(self) -> tuple[None, ...]:
        return (None,) * self.num_layers

    @property
    def max_window(self) -> None:
        return None

    # ------------------------------------------------------------------------------- derived
    @property
    def has_moe(self) -> bool:
        return self.n_routed_experts > 0 and self.first_k_dense_replace < self.num_layers

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        """qk_head_dim ** -0.5, times mscale(factor, mscale_all_dim) ** 2 under YaRN (transformers' yarn_apply_mscale)."""
        scale = self.qk_head_dim ** -0.5
        mscale_all_dim = self.rope_scaling.get("mscale_all_dim", 0)
        if self.rope_type != "default" and mscale_all_dim:
            m = yarn_mscale(self.rope_scaling["factor"], mscale_all_dim)
            scale = scale * m * m
        return scale


def _check_int(name: str, value, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an int >= {low}, got {value!r}")


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature: 0.1 * mscale * ln(scale) + 1 (1 for scale <= 1)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_parameters(config: DeepseekConfig) -> tuple[torch.Tensor, float]:
    """float32 (qk_rope_head_dim // 2,) inverse frequencies and the factor cos/sin are scaled by
    (transformers' default and _compute_yarn_parameters)."""
    dim, base = config.qk_rope_head_dim, config.rope_theta
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)
    if config.rope_type == "default":
        return 1.0 / pos_freqs, 1.0
    p = config.rope_scaling
    factor = p["factor"]
    original = p.get("original_max_position_embeddings") or config.max_position_embeddings
    attention_factor = p.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = p.get("mscale"), p.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = float(yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim))
        else:
            attention_factor = yarn_mscale(factor)
    beta_fast, beta_slow = p.get("beta_fast") or 32, p.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp  # 1: keep the original frequency; 0: divide it by `factor`
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention_factor)


def rope_cos_sin(inv_freq: torch.Tensor, attention_factor: float, positions: torch.Tensor, dtype: torch.dtype):
    """cos, sin (B, S, qk_rope_head_dim // 2) in `dtype`, scaled by attention_factor; positions
    int64 (B, S), padding (-1) rotated as 0."""
    angles = positions.clamp(min=0)[..., None].float() * inv_freq.to(positions.device)
    return (angles.cos() * attention_factor).to(dtype), (angles.sin() * attention_factor).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool) -> torch.Tensor:
    """Rotate x (B, S, H, d) by cos, sin (B, S, d/2). interleave: pairs (x0, x1), (x2, x3), ...
    with the result de-interleaved (evens' rotations first), as transformers' V3 does; V2's
    complex form gives the same pairs interleaved, a permutation applied to q and k alike, so the
    scores are the same. Otherwise the rotate-half layout."""
    cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
    if interleave:
        x1, x2 = x[..., 0::2], x[..., 1::2]
    else:
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def prefers_naive(num_queries: int, num_keys: int, config: DeepseekConfig) -> bool:
    """Whether the naive (decompressed) form costs fewer flops than the absorbed one for a block
    of num_queries queries over num_keys keys of one rank.

    absorbed: per (query, key) pair 2 (D + Dv) = 2 (2 kv_lora_rank + qk_rope) per head, plus the
              query's absorption and the output's up-projection (2 kv_lora_rank (nope + v) per
              query and head);
    naive:    2 (qk_head_dim + v_head_dim) per pair and head, plus decompressing every key
              (2 kv_lora_rank (nope + v) per key and head).
    Decode (one query) is always absorbed; see docs/benchmarks.md for the measured crossover.
    """
    c = config
    up = 2 * c.kv_lora_rank * (c.qk_nope_head_dim + c.v_head_dim)
    absorbed = num_queries * num_keys * 2 * (2 * c.kv_lora_rank + c.qk_rope_head_dim) + num_queries * up
    naive = num_queries * num_keys * 2 * (c.qk_head_dim + c.v_head_dim) + num_keys * up
    return naive < absorbed


class MLAttention(nn.Module):
    """Multi-head latent attention of one layer (see the module doc)."""

    def __init__(self, config: DeepseekConfig, layer: int) -> None:
        super().__init__()
        self.config, self.layer = config, layer
        c, d = config, config.hidden_size
        H = self.num_heads = c.num_heads  # the heads this module runs (a tensor-parallel plan narrows them)
        if c.q_lora_rank is None:
            self.q_proj = nn.Linear(d, H * c.qk_head_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(d, c.q_lora_rank, bias=c.attention_bias)
            self.q_a_layernorm = RMSNorm(c.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(c.q_lora_rank, H * c.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(d, c.kv_lora_rank + c.qk_rope_head_dim, bias=c.attention_bias)
        self.kv_a_layernorm = RMSNorm(c.kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(c.kv_lora_rank, H * (c.qk_nope_head_dim + c.v_head_dim), bias=False)
        self.o_proj = nn.Linear(H * c.v_head_dim, d, bias=c.attention_bias)

    def up_projections(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of kv_b_proj's weight: W_UK (H, qk_nope_head_dim, kv_lora_rank), W_UV (H, v_head_dim, kv_lora_rank)."""
        c = self.config
        w = self.kv_b_proj.weight.view(self.num_heads, c.qk_nope_head_dim + c.v_head_dim, c.kv_lora_rank)
        return w[:, : c.qk_nope_head_dim], w[:, c.qk_nope_head_dim :]

    def forward(self, x, positions, cos, sin, kv_store: KVStore, attend: AttendFn, form: str) -> torch.Tensor:
        c = self.config
        B, S, _ = x.shape
        H, rank = self.num_heads, c.kv_lora_rank
        q = self.q_proj(x) if c.q_lora_rank is None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q_nope, q_rope = q.view(B, S, H, c.qk_head_dim).split([c.qk_nope_head_dim, c.qk_rope_head_dim], dim=-1)
        latent, k_rope = self.kv_a_proj_with_mqa(x).split([rank, c.qk_rope_head_dim], dim=-1)
        q_rope = apply_rope(q_rope, cos, sin, c.rope_interleave)
        k_rope = apply_rope(k_rope.view(B, S, 1, c.qk_rope_head_dim), cos, sin, c.rope_interleave)
        entry = torch.cat((self.kv_a_layernorm(latent).view(B, S, 1, rank), k_rope), dim=-1)  # (B, S, 1, rank + rope)
        k_all, v_all, kv_pos = kv_store(self.layer, entry, entry[..., :rank])
        w_uk, w_uv = self.up_projections()
        naive = isinstance(k_all, torch.Tensor) and (form == "naive" or (
            form == "auto" and S > 1 and getattr(attend, "name", None) == "local" and prefers_naive(S, k_all.shape[1], c)))
        if naive:
            out = self._naive(q_nope, q_rope, k_all, positions, kv_pos, attend, w_uk, w_uv)
        else:
            out = self._absorbed(q_nope, q_rope, k_all, v_all, positions, kv_pos, attend, w_uk, w_uv)
        return self.o_proj(out.reshape(B, S, H * c.v_head_dim))

    def _absorbed(self, q_nope, q_rope, k_all, v_all, positions, kv_pos, attend, w_uk, w_uv) -> torch.Tensor:
        """MQA over the latent entries. q_nope (B, S, H, nope), q_rope (B, S, H, rope) -> (B, S, H, v_head_dim)."""
        c = self.config
        q_latent = torch.einsum("bshn,hnr->bshr", q_nope, w_uk)  # (B, S, H, kv_lora_rank)
        D = c.kv_lora_rank + c.qk_rope_head_dim
        q = torch.cat((q_latent, q_rope), dim=-1) * (c.softmax_scale * math.sqrt(D))
        out_latent = attend(q, k_all, v_all, q_pos=positions, kv_pos=kv_pos, window=None)  # (B, S, H, kv_lora_rank)
        return torch.einsum("bshr,hvr->bshv", out_latent, w_uv)

    def _naive(self, q_nope, q_rope, entries, positions, kv_pos, attend, w_uk, w_uv) -> torch.Tensor:
        """MHA over this rank's decompressed shard. entries (B, Sk, 1, rank + rope) -> (B, S, H, v_head_dim)."""
        c = self.config
        B, Sk = entries.shape[:2]
        latent, k_rope = entries[:, :, 0].split([c.kv_lora_rank, c.qk_rope_head_dim], dim=-1)
        k_nope = torch.einsum("bkr,hnr->bkhn", latent, w_uk)
        v = torch.einsum("bkr,hvr->bkhv", latent, w_uv)
        k = torch.cat((k_nope, k_rope[:, :, None].expand(B, Sk, self.num_heads, c.qk_rope_head_dim)), dim=-1)
        q = torch.cat((q_nope, q_rope), dim=-1) * (c.softmax_scale * math.sqrt(c.qk_head_dim))
        return attend(q, k, v, q_pos=positions, kv_pos=kv_pos, window=None)


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden: int, intermediate: int, bias: bool = False) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.up_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Router(nn.Module):
    """Chooses num_experts_per_tok routed experts per token and their weights (see the module doc)."""

    def __init__(self, config: DeepseekConfig) -> None:
        super().__init__()
        self.config = config
        self.weight = nn.Parameter(torch.empty(config.n_routed_experts, config.hidden_size))
        if config.router == "v3":  # a checkpoint tensor, kept in float32 (as transformers does)
            self.e_score_correction_bias = nn.Parameter(torch.zeros(config.n_routed_experts), requires_grad=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x (T, hidden) -> weights float32 (T, k), expert indices int64 (T, k)."""
        c = self.config
        logits = F.linear(x.float(), self.weight.float())
        T, E, G = x.shape[0], c.n_routed_experts, c.n_group
        if c.router == "v3":
            scores = logits.sigmoid()
            choice = scores + self.e_score_correction_bias.float()
            group_scores = choice.view(T, G, E // G).topk(2, dim=-1)[0].sum(dim=-1)
            choice = choice.masked_fill(~self._group_mask(group_scores), float("-inf"))
            index = torch.topk(choice, k=c.num_experts_per_tok, dim=-1, sorted=False)[1]
            weights = scores.gather(1, index)
            if c.norm_topk_prob:
                weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        else:
            scores = logits.softmax(dim=-1, dtype=torch.float32)
            if c.router == "group_limited_greedy":
                group_scores = scores.view(T, G, E // G).max(dim=-1).values
                scores = scores.masked_fill(~self._group_mask(group_scores), 0.0)
            weights, index = torch.topk(scores, k=c.num_experts_per_tok, dim=-1, sorted=False)
        return weights * c.routed_scaling_factor, index

    def _group_mask(self, group_scores: torch.Tensor) -> torch.Tensor:
        """bool (T, E): the experts of each token's topk_group best groups."""
        c = self.config
        T, G = group_scores.shape
        best = torch.topk(group_scores, k=c.topk_group, dim=-1, sorted=False)[1]
        groups = torch.zeros(T, G, dtype=torch.bool, device=group_scores.device).scatter_(1, best, True)
        return groups[:, :, None].expand(T, G, c.n_routed_experts // G).reshape(T, c.n_routed_experts)


class MoE(nn.Module):
    """Routed experts (weighted by the router) plus the shared experts (always on)."""

    def __init__(self, config: DeepseekConfig) -> None:
        super().__init__()
        self.gate = Router(config)
        self.experts = nn.ModuleList(MLP(config.hidden_size, config.moe_intermediate_size, config.mlp_bias)
                                     for _ in range(config.n_routed_experts))
        shared = config.moe_intermediate_size * config.n_shared_experts
        self.shared_experts = MLP(config.hidden_size, shared, config.mlp_bias) if shared else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        weights, index = self.gate(flat)
        out = torch.zeros_like(flat)
        for e in index.unique().tolist():  # experts in ascending order, as transformers sums them
            token, slot = torch.where(index == e)
            y = self.experts[e](flat[token]) * weights[token, slot, None]
            out.index_add_(0, token, y.to(out.dtype))
        out = out.view(shape)
        return out if self.shared_experts is None else out + self.shared_experts(x)


class DecoderLayer(nn.Module):
    def __init__(self, config: DeepseekConfig, layer: int) -> None:
        super().__init__()
        self.self_attn = MLAttention(config, layer)
        moe = config.n_routed_experts > 0 and layer >= config.first_k_dense_replace
        self.mlp = MoE(config) if moe else MLP(config.hidden_size, config.intermediate_size, config.mlp_bias)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, h, positions, cos, sin, kv_store: KVStore, attend: AttendFn, chunk: int, form: str) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), positions, cos, sin, kv_store, attend, form)
        for start in range(0, h.shape[1], chunk):  # bound the MLP's activations to `chunk` tokens
            part = h[:, start : start + chunk]
            part += self.mlp(self.post_attention_layernorm(part))
        return h


class DeepseekModel(nn.Module):
    """A DeepSeek-V2/V3 causal language model with the interface of LlamaModel: forward(tokens,
    positions, kv_store, attend, chunk=) -> hidden states, logits(hidden).

    Args:
        config: DeepseekConfig.
        dtype, device: of the parameters ("meta" builds the skeleton the loader fills).
        attention_form: "auto", "absorbed" or "naive" (module doc); an attribute, may be changed.
    """

    def __init__(self, config: DeepseekConfig, *, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 attention_form: str = "auto") -> None:
        super().__init__()
        if attention_form not in ATTENTION_FORMS:
            raise ValueError(f"attention_form must be one of {ATTENTION_FORMS}, got {attention_form!r}")
        self.config = config
        self.attention_form = attention_form
        with torch.device(device):
            self.embed_tokens = embedding(config.vocab_size, config.hidden_size, device)
            self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
            self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
            self.lm_head = None if config.tie_word_embeddings else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.to(dtype)
        self.tokenizer = None
        self.chat_template = None
        self.inv_freq, self.attention_factor = rope_parameters(config)  # float32, plain attributes

    # The config keys that set each attention tensor's shape, named when a checkpoint disagrees (the loader reads this).
    SHAPE_KEYS = {
        "q_proj.weight": "num_attention_heads * (qk_nope_head_dim + qk_rope_head_dim), hidden_size",
        "q_a_proj.weight": "q_lora_rank, hidden_size",
        "q_a_layernorm.weight": "q_lora_rank",
        "q_b_proj.weight": "num_attention_heads * (qk_nope_head_dim + qk_rope_head_dim), q_lora_rank",
        "kv_a_proj_with_mqa.weight": "kv_lora_rank + qk_rope_head_dim, hidden_size",
        "kv_a_layernorm.weight": "kv_lora_rank",
        "kv_b_proj.weight": "num_attention_heads * (qk_nope_head_dim + v_head_dim), kv_lora_rank",
        "self_attn.o_proj.weight": "hidden_size, num_attention_heads * v_head_dim",
    }
    FLOAT32_PARAMETERS = ("e_score_correction_bias",)  # kept in float32 whatever the dtype (the loader reads this)

    def to(self, *args, **kwargs):
        """Module.to, keeping the routers' e_score_correction_bias in float32 (as transformers does)."""
        super().to(*args, **kwargs)
        for name, param in self.named_parameters():
            if name.endswith(self.FLOAT32_PARAMETERS) and param.dtype != torch.float32:
                param.data = param.data.float()
        return self

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, kv_store: KVStore, attend: AttendFn, *,
                chunk: int = 1024) -> torch.Tensor:
        """tokens, positions int64 (B, S) -> final hidden states (B, S, hidden_size) in the model dtype.

        kv_store(layer, entry, entry[..., :kv_lora_rank]) gets each layer's new cache entries
        (B, S, 1, kv_lora_rank + qk_rope_head_dim) and returns what this rank attends to; attend is
        the attention algorithm (treeattn.models.llama's module doc)."""
        h = self.embed_tokens(tokens)
        if self.inv_freq.device != h.device:
            self.inv_freq = self.inv_freq.to(h.device)
        cos, sin = rope_cos_sin(self.inv_freq, self.attention_factor, positions, h.dtype)
        for layer in self.layers:
            h = layer(h, positions, cos, sin, kv_store, attend, chunk, self.attention_form)
        return self.norm(h)

    def logits(self, hidden: torch.Tensor, vocab: slice | None = None, weight: torch.Tensor | None = None) -> torch.Tensor:
        """(..., hidden_size) final hidden states -> (..., vocab_size) float32 logits (the columns of
        `vocab` only, as LlamaModel.logits; `weight`: another output projection, e.g. some of its rows, multiplied in
        float32 by ops.dense_linear.linear_float32 as LlamaModel.logits does, a prepacked one too)."""
        if weight is not None:
            out = linear_float32(hidden.to(weight.dtype), weight if vocab is None else weight[vocab])
            return out.to(hidden.dtype).float()
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(hidden, weight if vocab is None else weight[vocab]).float()


# ------------------------------------------------------------------------------ config.json

ARCHITECTURES = {"DeepseekV2ForCausalLM": "deepseek_v2", "DeepseekV3ForCausalLM": "deepseek_v3"}


def config_from_dict(raw: dict, architecture: str, *, source: str = "config.json") -> DeepseekConfig:
    """A DeepseekConfig from a Hugging Face config dict of `architecture` (DeepseekV2ForCausalLM or
    DeepseekV3ForCausalLM), with transformers' defaults for the keys it omits. Features not
    implemented are refused with a ValueError naming `source` and the key."""
    v3 = architecture == "DeepseekV3ForCausalLM"
    defaults = _V3_DEFAULTS if v3 else _V2_DEFAULTS

    get = config_reader(raw, source, defaults)

    def refuse(key: str, value, supported: str) -> None:
        raise ValueError(f"{source}: {key}={value!r} is not implemented for {architecture} (supported: {supported})")

    router = _router(raw, v3, get, refuse)
    theta, rope_type, scaling = _rope(raw, source, refuse)
    routed = get("n_routed_experts", int) or 0
    values = dict(
        vocab_size=get("vocab_size", int),
        hidden_size=get("hidden_size", int),
        intermediate_size=get("intermediate_size", int),
        num_layers=get("num_hidden_layers", int),
        num_heads=get("num_attention_heads", int),
        kv_lora_rank=get("kv_lora_rank", int),
        q_lora_rank=raw.get("q_lora_rank", defaults["q_lora_rank"]),
        qk_nope_head_dim=get("qk_nope_head_dim", int),
        qk_rope_head_dim=get("qk_rope_head_dim", int),
        v_head_dim=get("v_head_dim", int),
        moe_intermediate_size=get("moe_intermediate_size", int),
        n_routed_experts=routed,
        n_shared_experts=get("n_shared_experts", int, defaults.get("n_shared_experts") or 0),
        num_experts_per_tok=get("num_experts_per_tok", int, defaults.get("num_experts_per_tok") or 0) if routed else 0,
        first_k_dense_replace=get("first_k_dense_replace", int),
        router=router,
        n_group=get("n_group", int, defaults.get("n_group") or 1),
        topk_group=get("topk_group", int, defaults.get("topk_group") or 1),
        routed_scaling_factor=float(get("routed_scaling_factor", float)),
        norm_topk_prob=get("norm_topk_prob", bool) if v3 else False,
        rms_norm_eps=float(get("rms_norm_eps", float, 1e-6)),
        rope_theta=float(theta),
        rope_type=rope_type,
        rope_scaling=scaling,
        rope_interleave=get("rope_interleave", bool, True) if v3 else True,
        attention_bias=get("attention_bias", bool, False),
        mlp_bias=False if v3 else get("mlp_bias", bool, False),
        tie_word_embeddings=get("tie_word_embeddings", bool, False),
        max_position_embeddings=get("max_position_embeddings", int),
        num_mtp_layers=get("num_nextn_predict_layers", int, 0) if v3 else 0,
        architecture=architecture,
        bos_token_id=get("bos_token_id", int, None),
        eos_token_ids=_token_ids(raw.get("eos_token_id"), source),
    )
    if values["q_lora_rank"] is not None and (isinstance(values["q_lora_rank"],
                                                         bool) or not isinstance(values["q_lora_rank"], int)):
        raise ValueError(f"{source}: key 'q_lora_rank' must be int or null, got {values['q_lora_rank']!r}")
    try:
        return DeepseekConfig(**values)
    except ValueError as exc:
        raise ValueError(f"{source}: {exc}") from exc


def _router(raw: dict, v3: bool, get, refuse) -> str:
    """The checkpoint's router ("v3", "greedy" or "group_limited_greedy"), after refusing (through
    `refuse`) the features config_from_dict does not implement; `get` reads a typed key."""
    if raw.get("quantization_config") is not None:
        method = raw["quantization_config"].get("quant_method") if isinstance(raw["quantization_config"], dict) else None
        refuse("quantization_config", method, "unquantized checkpoints; dequantize the weights first (e.g. FP8 block scales)")
    if get("hidden_act", str) != "silu":
        refuse("hidden_act", raw["hidden_act"], "'silu'")
    if get("moe_layer_freq", int, 1) != 1:
        refuse("moe_layer_freq", raw["moe_layer_freq"], "1: every layer from first_k_dense_replace on is MoE")
    scoring = raw.get("scoring_func")
    if scoring is not None and scoring != ("sigmoid" if v3 else "softmax"):
        refuse("scoring_func", scoring, "'sigmoid'" if v3 else "'softmax'")
    if v3:
        router = "v3"
        method = raw.get("topk_method")
        if method not in (None, "noaux_tc"):
            refuse("topk_method", method, "'noaux_tc'")
    else:
        router = get("topk_method", str)
        if router not in ("greedy", "group_limited_greedy"):
            refuse("topk_method", router, "'greedy', 'group_limited_greedy'")
        if get("norm_topk_prob", bool):
            refuse("norm_topk_prob", True,
                   "false (transformers' DeepseekV2 router ignores it; DeepSeek's reference code applies it)")
    if not v3 and raw.get("rope_interleave") is False:
        refuse("rope_interleave", False, "true (DeepseekV2 always rotates interleaved pairs)")
    return router


# transformers 5's defaults (configuration_deepseek_v3.py / configuration_deepseek_v2.py) for keys a config.json may omit.
_V3_DEFAULTS = dict(q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                    moe_intermediate_size=2048, n_routed_experts=256, n_shared_experts=1, num_experts_per_tok=8,
                    first_k_dense_replace=3, n_group=8, topk_group=4, routed_scaling_factor=2.5, norm_topk_prob=True,
                    hidden_act="silu", max_position_embeddings=4096)
_V2_DEFAULTS = dict(q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                    moe_intermediate_size=1407, n_routed_experts=64, n_shared_experts=2, first_k_dense_replace=0,
                    routed_scaling_factor=1.0, topk_method="greedy", norm_topk_prob=False, hidden_act="silu",
                    max_position_embeddings=2048)


def _rope(raw: dict, source: str, refuse) -> tuple[float, str, dict]:
    """(rope_theta, rope_type, scaling parameters) from rope_parameters (transformers 5) or
    rope_theta + rope_scaling (DeepSeek's own config.json)."""
    key = "rope_parameters" if raw.get("rope_parameters") is not None else "rope_scaling"
    params = raw.get(key) or {}
    if not isinstance(params, dict):
        raise ValueError(f"{source}: key {key!r} must be an object, got {params!r}")
    params = dict(params)
    theta = params.pop("rope_theta", raw.get("rope_theta", 10000.0))
    rope_type = params.pop("rope_type", params.pop("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        refuse(f"{key}.rope_type", rope_type, ", ".join(SUPPORTED_ROPE_TYPES))
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        refuse(f"{key}.partial_rotary_factor", params["partial_rotary_factor"], "1.0")
    if not isinstance(theta, (int, float)) or isinstance(theta, bool) or not (math.isfinite(theta) and theta > 0):
        raise ValueError(f"{source}: rope_theta must be a finite positive number, got {theta!r}")
    if rope_type == "yarn":
        for name in ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale", "mscale_all_dim",
                     "attention_factor"):
            value = params.get(name)
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0
            ):
                raise ValueError(f"{source}: {key}.{name} must be a finite number >= 0, got {value!r}")
        if not params.get("factor"):
            raise ValueError(f"{source}: rope type 'yarn' needs a positive number {key}.factor, got {params.get('factor')!r}")
    return float(theta), rope_type, params


def _token_ids(value, source: str) -> tuple[int, ...]:
    if value is None:
        return ()
    values = value if isinstance(value, list) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise ValueError(f"{source}: 'eos_token_id' must be a token id or a list of them, got {value!r}")
    return tuple(values)
