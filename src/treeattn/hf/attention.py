"""The "treeattn" attention implementation for transformers models (AttentionInterface).

transformers calls it once per layer as

    attn_output, attn_weights = sharded_attention(module, query, key, value, attention_mask,
                                                  scaling=..., dropout=..., sliding_window=..., softcap=...)

with query (B, Hq, S, D) after RoPE and q/k norms, and key, value (B, Hkv, L, D) as returned by
the cache's update(): with a treeattn.hf.ShardedCache, this rank's shard only. The absolute
positions of the queries and of the shard's keys come from that cache, which binds itself to this
function for the forward passes run inside its prefill()/decode() blocks (a context variable:
nothing else is shared between them). attn_output is (B, S, Hq, Dv); attn_weights is None.

- prefill (each rank runs its own part of the prompt): ring_attention across the ranks.
- decode (every rank runs the same tokens): tree_decode across the ranks.
- one process without torch.distributed: treeattn.ops.attention over the whole cache.

Both are causal by absolute positions, apply the layer's sliding window and logit softcap
exactly, and use transformers' `scaling`. No attention mask is built or read: masking is by
positions (the "treeattn" name is not in transformers' mask interface, so the models pass None).
Anything the function does not implement (dropout in training, bidirectional attention, attention
sinks or other extra arguments) raises NotImplementedError naming the model's attention class,
rather than being ignored.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import torch

from treeattn.cache.sharded import INVISIBLE_POSITION
from treeattn.ops import attention
from treeattn.parallel import ring_attention, tree_decode

ATTN_IMPLEMENTATION = "treeattn"

# Keyword arguments transformers' models pass through to every attention function that carry no
# information this implementation needs (positions come from the cache).
IGNORED_KWARGS = frozenset({"position_ids", "use_cache", "output_attentions", "output_hidden_states", "output_router_logits",
                            "cache_position", "return_dict", "past_key_value", "past_key_values", "cache"})

_BOUND_CACHE: contextvars.ContextVar = contextvars.ContextVar("treeattn_hf_cache", default=None)


@contextlib.contextmanager
def bind_cache(cache) -> Iterator[None]:
    """Make `cache` (a ShardedCache) the one sharded_attention reads positions from, in this context."""
    token = _BOUND_CACHE.set(cache)
    try:
        yield
    finally:
        _BOUND_CACHE.reset(token)


def sharded_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Exact causal attention of this forward pass's queries over the KV cache sharded across ranks.

    Args:
        module: the model's attention module (layer_idx, is_causal are read).
        query: (B, Hq, S, D); key: (B, Hkv, L, D), value: (B, Hkv, L, Dv): this rank's shard.
        attention_mask: must be None (masking is by absolute positions).
        scaling: softmax scale (default D ** -0.5); sliding_window: W or None; softcap: c or None.

    Returns:
        (out (B, S, Hq, Dv) in query.dtype, None).
    """
    name = type(module).__name__
    cache = _BOUND_CACHE.get()
    if cache is None:
        raise RuntimeError(
            f"{name}: attn_implementation='{ATTN_IMPLEMENTATION}' runs only inside `with cache.prefill(ids):` or "
            "`with cache.decode():` of a treeattn.hf.ShardedCache passed to the model as its cache (tahf.generate does this)"
        )
    _check_supported(module, name, attention_mask, dropout, kwargs)
    layer = module.layer_idx
    q_pos, kv_pos, check = cache.attention_inputs(layer, key)
    _check_position_ids(kwargs.get("position_ids"), q_pos, name, layer)
    q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)  # (B, S, H, D) views
    if cache.placeholder:  # this rank holds no prompt token: take part with no query, output zeros
        out, _ = ring_attention(q[:, :0], k, v, group=cache.group, scale=scaling, causal=True, q_pos=q_pos, kv_pos=kv_pos,
                                window=sliding_window, softcap=softcap, check_inputs=check)
        return torch.zeros(*q.shape[:3], v.shape[-1], dtype=q.dtype, device=q.device), None
    if not cache.distributed:  # one process: the whole cache is here
        out, _ = attention(q, k, v, scale=scaling, causal=True, q_pos=q_pos, kv_pos=kv_pos, window=sliding_window,
                           softcap=softcap)
    elif cache.phase == "prefill":
        out, _ = ring_attention(q, k, v, group=cache.group, scale=scaling, causal=True, q_pos=q_pos, kv_pos=kv_pos,
                                window=sliding_window, softcap=softcap, check_inputs=check)
    else:
        out = _decode(cache, q, k, v, q_pos, kv_pos, scaling, sliding_window, softcap, check)
    return out, None


def _decode(cache, q, k, v, q_pos, kv_pos, scale, window, softcap, check) -> torch.Tensor:
    """tree_decode with causal positions; a sliding window hides the keys outside it by moving their
    positions past the query (one query at a time when the window differs between queries)."""

    def combine(q_rows, q_positions, kv_positions):
        out, _ = tree_decode(q_rows, k, v, group=cache.group, scale=scale, q_pos=q_positions, kv_pos=kv_positions,
                             method=cache.method, topology=cache.topology, softcap=softcap, check_inputs=check)
        return out

    if window is None or int(q_pos.max()) < window:  # q_pos is the same on every rank
        return combine(q, q_pos, kv_pos)
    outs = []
    for i in range(q.shape[1]):
        qp = q_pos[i : i + 1]
        hidden = torch.where(qp - kv_pos >= window, torch.full_like(kv_pos, INVISIBLE_POSITION), kv_pos)
        outs.append(combine(q[:, i : i + 1], qp, hidden))
    return torch.cat(outs, dim=1)


def _check_supported(module, name: str, attention_mask, dropout, kwargs) -> None:
    if attention_mask is not None:
        raise NotImplementedError(
            f"{name}: the treeattn attention masks by absolute positions and takes no attention mask "
            f"(got one of shape {tuple(attention_mask.shape)}); padding is not supported"
        )
    if not getattr(module, "is_causal", True) or kwargs.get("is_causal") is False:
        raise NotImplementedError(f"{name}: bidirectional attention cannot be decoded with treeattn (it is causal only)")
    if dropout and module.training:
        raise NotImplementedError(f"{name}: attention dropout in training mode is not supported (call model.eval())")
    extra = sorted(key for key, val in kwargs.items() if key not in IGNORED_KWARGS and key != "is_causal" and val is not None)
    if extra:
        raise NotImplementedError(
            f"{name} passes {extra} to its attention function, which treeattn does not implement "
            "(only softmax attention with scaling, sliding_window and softcap is)"
        )


def _check_position_ids(position_ids, q_pos: torch.Tensor, name: str, layer: int) -> None:
    """The model's position ids (used for RoPE) must be the cache's absolute positions (checked at layer 0)."""
    if position_ids is None or layer != 0 or q_pos.numel() == 0:
        return
    if position_ids.shape[-1] != q_pos.numel() or not bool((position_ids == q_pos.to(position_ids.device)).all()):
        raise ValueError(
            f"{name}: position_ids {position_ids.tolist() if position_ids.numel() <= 16 else tuple(position_ids.shape)} "
            f"differ from the ShardedCache's absolute positions {q_pos.tolist() if q_pos.numel() <= 16 else tuple(q_pos.shape)}"
        )
