"""Hybrid models: a Llama-family model whose chosen layers run linear attention with Hedgehog maps.

    model = ta.load_model("SmolLM2.gguf")
    linearize_layers(model, layers=[1, 3, 5], feature_dim=64)   # those layers' attention becomes linear
    load_feature_maps(model, "maps/")                           # the trained maps (treeattn linearize)

A linearized layer keeps its q/k/v/o projections (the same weights) and RoPE; phi_q and phi_k are
per-KV-head HedgehogFeatureMaps applied to the rotated queries and keys (LoLCATs' placement). It
stores no key or value: per sequence it keeps one LinearAttentionState (F x Dv per KV head) that
every new token adds to. The other layers stay softmax and use the KV cache as before.

The model knows nothing of ranks or caches: like softmax attention (the `attend` callable), linear
attention is injected. A hybrid forward pass gets a HybridStore as its kv_store: softmax layers'
keys and values go to the wrapped store (its layer i is the i-th softmax layer, so the cache holds
softmax layers only), and a linear layer calls store.linear(layer, q, k, v, feature_maps), which
runs ta.linear_attention from the sequence's state and keeps the new state. With prefill_group
set, each rank passes its own contiguous chunk of the prompt and the states come across ranks
(treeattn.linear.exchange); decoding (every rank runs the same token) needs no communication.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from treeattn.linear.attention import linear_attention
from treeattn.linear.feature_maps import HedgehogFeatureMap
from treeattn.linear.kernel import LinearAttentionState
from treeattn.ops.rowwise import apply_rope

FEATURE_MAPS_FILE = "feature_maps.safetensors"
CONFIG_FILE = "linear_layers.json"


class LinearizedAttention(nn.Module):
    """Drop-in for treeattn.models.llama.Attention: the same projections, linear attention inside.

    Args:
        attention: the layer's softmax Attention; its projection modules are shared, not copied.
        feature_dim: Hedgehog features per map before the [y, -y] doubling (F = 2 * feature_dim).
    """

    def __init__(self, attention: nn.Module, feature_dim: int) -> None:
        super().__init__()
        self.layer = attention.layer
        self.num_heads, self.num_kv_heads, self.head_dim = attention.num_heads, attention.num_kv_heads, attention.head_dim
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (
            attention.q_proj,
            attention.k_proj,
            attention.v_proj,
            attention.o_proj,
        )
        # nn.Linear or packed
        params = dict(dtype=torch.float32, device=next(iter(attention.q_proj.state_dict().values())).device)
        self.feature_map_q = HedgehogFeatureMap(self.num_kv_heads, self.head_dim, feature_dim, **params)
        self.feature_map_k = HedgehogFeatureMap(self.num_kv_heads, self.head_dim, feature_dim, **params)

    def project(self, x, cos, sin) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q (B, S, Hq, D), k, v (B, S, Hkv, D) with RoPE applied to q and k, as the softmax layer has them."""
        B, S, _ = x.shape
        q = apply_rope(self.q_proj(x).view(B, S, self.num_heads, self.head_dim), cos, sin)
        k = apply_rope(self.k_proj(x).view(B, S, self.num_kv_heads, self.head_dim), cos, sin)
        return q, k, self.v_proj(x).view(B, S, self.num_kv_heads, self.head_dim)

    def forward(self, x, positions, cos, sin, kv_store, attend) -> torch.Tensor:
        linear = getattr(kv_store, "linear", None)
        if linear is None:
            raise TypeError(f"kv_store of a hybrid model must be a treeattn.linear.HybridStore (layer {self.layer} is linear), "
                            f"got {type(kv_store).__name__}")
        if bool((positions < 0).any()):
            raise ValueError(f"positions: a linear layer (layer {self.layer}) takes no padding (-1); run sequences unpadded")
        B, S, _ = x.shape
        q, k, v = self.project(x, cos, sin)
        out = linear(self.layer, q, k, v, (self.feature_map_q, self.feature_map_k))
        return self.o_proj(out.reshape(B, S, self.num_heads * self.head_dim))


class LinearStates:
    """The linear layers' states of the sequences of one batch: O(1) in the sequence length."""

    def __init__(self) -> None:
        self.states: dict[int, LinearAttentionState] = {}

    def nbytes(self) -> int:
        return sum(state.nbytes for state in self.states.values())

    def clear(self) -> None:
        self.states.clear()


class SequenceStates:
    """The linear layers' states of the engine's sequences on one rank: per sequence and linear
    layer, the LinearAttentionState after its last step and the position that step ended at. Every
    rank keeps the same (a hybrid model's steps run every token on every rank), so linear layers
    need no communication in the engine. O(1) in the sequence's length.

        states = SequenceStates()
        out = states.attend(layer, seq_id, start, q, k, v, feature_maps)   # a step of one sequence
        states.release(seq_id)                                             # finished or preempted
    """

    def __init__(self) -> None:
        self._states: dict[int, dict[int, tuple[LinearAttentionState, int]]] = {}

    def attend(self, layer: int, seq_id: int, start: int, q, k, v, feature_maps) -> torch.Tensor:
        """Linear attention of positions [start, start + n) of sequence `seq_id` in `layer`, from its
        state (none at start 0), keeping the new state.

        Args:
            q: (1, n, Hq, D); k: (1, n, Hkv, D); v: (1, n, Hkv, Dv) -- RoPE applied to q and k.
            feature_maps: the layer's (phi_q, phi_k).

        Returns:
            out (1, n, Hq, Dv) in q's dtype (float32 accumulation).

        Raises:
            RuntimeError: start > 0 and the sequence's state in this layer does not end at `start`.
        """
        layers = self._states.setdefault(seq_id, {})
        state = None
        if start > 0:
            kept = layers.get(layer)
            if kept is None or kept[1] != start:
                have = "no state" if kept is None else f"a state ending at position {kept[1]}"
                raise RuntimeError(f"linear states: sequence {seq_id} continues at position {start} in layer {layer}, "
                                   f"but has {have}")
            state = kept[0]
        out, new = linear_attention(q, k, v, feature_map=feature_maps, causal=True, return_state=True, initial_state=state,
                                    check_inputs=False)
        layers[layer] = (new, start + q.shape[1])
        return out

    def release(self, seq_id: int) -> None:
        self._states.pop(seq_id, None)

    def nbytes(self) -> int:
        return sum(state.nbytes for layers in self._states.values() for state, _ in layers.values())


class HybridStore:
    """The kv_store of one forward pass of a hybrid model.

    Args:
        kv_store: the softmax layers' store (e.g. a ShardedKVCache's CacheUpdate), called with the
            softmax layer's index among the softmax layers (softmax_index[layer]); None if every
            layer is linear.
        states: the batch's LinearStates (kept across forward passes).
        softmax_index: model layer -> cache layer, for the softmax layers.
        prefill_group: None (every rank runs every token of this pass: decoding, or one process), or
            the group across which each rank holds its own contiguous chunk of this pass's tokens.
    """

    def __init__(self, kv_store, states: LinearStates, softmax_index: dict[int, int], *,
                 prefill_group: dist.ProcessGroup | None = None) -> None:
        self.kv_store, self.states, self.softmax_index, self.prefill_group = kv_store, states, softmax_index, prefill_group

    def __call__(self, layer: int, k_new: torch.Tensor, v_new: torch.Tensor):
        return self.kv_store(self.softmax_index[layer], k_new, v_new)

    def linear(self, layer: int, q, k, v, feature_maps) -> torch.Tensor:
        out, self.states.states[layer] = linear_attention(
            q, k, v, feature_map=feature_maps, causal=True, group=self.prefill_group, return_state=True,
            initial_state=self.states.states.get(layer), check_inputs=False)
        return out


def check_linear_engine(layers: Sequence[int], *, decode_step: str = "dynamic", speculate: str | None = None,
                        windows: bool = False) -> None:
    """What the engine cannot run with a hybrid linear model (linear `layers`; () for a plain model),
    refused in one line (ValueError naming the option): static/graph decode steps, speculative
    decoding (a rejected draft would need the state before it), sliding-window layers beside linear
    ones. (The prefix cache is turned off: a cached prefix would need its linear states.) The one
    copy of these refusals: treeattn.engine.checks.check_linear (before any rank starts, for a loaded
    hybrid model or --linear-maps) and the runner (a rank's own guard) call it."""
    if not layers:
        return
    what = f"a hybrid linear model (linear layers {list(layers)})"
    if decode_step != "dynamic":
        raise ValueError(f"decode_step={decode_step!r} does not run {what}; use decode_step='dynamic'")
    if speculate is not None:
        raise ValueError(f"speculate={speculate!r} does not run {what}: a rejected draft would need the linear "
                         f"state before it; use speculate=None")
    if windows:
        raise ValueError(f"{what} with sliding-window layers is not supported")


def maps_layers(directory: str | Path) -> tuple[int, ...]:
    """The layers a feature-maps directory (`treeattn linearize --out`) linearizes."""
    return tuple(json.loads((Path(directory) / CONFIG_FILE).read_text())["layers"])


def linear_layers(model) -> tuple[int, ...]:
    """The indices of the model's linearized layers (() for a plain model)."""
    return tuple(i for i, layer in enumerate(model.layers) if isinstance(layer.self_attn, LinearizedAttention))


def softmax_index(model) -> dict[int, int]:
    """model layer -> index among the softmax layers (the layers a KV cache must hold)."""
    linear = set(linear_layers(model))
    return {layer: i for i, layer in enumerate(l for l in range(len(model.layers)) if l not in linear)}


def linearize_layers(model, layers: Sequence[int], feature_dim: int | None = None) -> None:
    """Replace the attention of `layers` (model layer indices) by LinearizedAttention, in place.

    feature_dim defaults to the head dim. The maps start at identity weights (untrained)."""
    n = len(model.layers)
    layers = list(layers)
    if not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < n for i in layers) or len(set(layers)) != len(layers):
        raise ValueError(f"layers must be distinct layer indices in [0, {n}), got {layers}")
    if model.config.layer_windows and any(model.config.layer_windows[i] is not None for i in layers):
        raise ValueError("layers: sliding-window layers cannot be linearized (their window is already O(1))")
    feature_dim = model.config.head_dim if feature_dim is None else feature_dim
    for i in layers:
        attention = model.layers[i].self_attn
        if not isinstance(attention, LinearizedAttention):
            model.layers[i].self_attn = LinearizedAttention(attention, feature_dim)


def feature_map_state(model) -> dict[str, torch.Tensor]:
    """The Hedgehog parameters of every linear layer, named layers.{i}.self_attn.feature_map_{q,k}.{weight,bias}."""
    return {name: p.detach().contiguous() for name, p in model.named_parameters() if ".feature_map_" in name}


def save_feature_maps(model, directory: str | Path, **metadata) -> Path:
    """Write the linear layers' maps (safetensors) and their description (json) into `directory`."""
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    layers = linear_layers(model)
    if not layers:
        raise ValueError("model has no linear layer: call linearize_layers first")
    feature_dim = model.layers[layers[0]].self_attn.feature_map_q.feature_dim
    save_file(feature_map_state(model), str(directory / FEATURE_MAPS_FILE))
    (directory / CONFIG_FILE).write_text(json.dumps({"layers": list(layers), "feature_dim": feature_dim, **metadata}, indent=2))
    return directory


def load_feature_maps(model, directory: str | Path, layers: Sequence[int] | None = None) -> tuple[int, ...]:
    """Linearize the layers named in `directory` (or the subset `layers` of them) and load their
    trained maps; returns the linearized layers."""
    from safetensors.torch import load_file

    directory = Path(directory)
    config_path, maps_path = directory / CONFIG_FILE, directory / FEATURE_MAPS_FILE
    for path in (config_path, maps_path):
        if not path.is_file():
            raise FileNotFoundError(f"feature maps directory {directory}: missing {path.name} (written by `treeattn linearize`)")
    config = json.loads(config_path.read_text())
    chosen = list(config["layers"]) if layers is None else list(layers)
    if not set(chosen) <= set(config["layers"]):
        raise ValueError(f"layers: {sorted(set(chosen) - set(config['layers']))} have no trained maps in {directory} "
                         f"(it has layers {config['layers']})")
    linearize_layers(model, chosen, config["feature_dim"])
    tensors = {name: t for name, t in load_file(str(maps_path)).items() if int(name.split(".")[1]) in chosen}
    expected = set(feature_map_state(model))
    if set(tensors) != expected:
        raise ValueError(f"{maps_path}: tensors {sorted(set(tensors) ^ expected)[:4]} missing or unexpected for layers "
                         f"{config['layers']}")
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, tensor in tensors.items():
            if params[name].shape != tensor.shape:
                raise ValueError(f"{maps_path}: {name} has shape {tuple(tensor.shape)}, the model needs "
                                 f"{tuple(params[name].shape)}")
            params[name].copy_(tensor)
    return tuple(chosen)


def load_hybrid(model_path: str | Path, maps_directory: str | Path, layers: Sequence[int] | None = None, **load_kwargs):
    """ta.load_model(model_path) with the linear layers (all, or `layers`) and maps of `maps_directory`."""
    from treeattn.models import load_model

    model = load_model(model_path, **load_kwargs)
    load_feature_maps(model, maps_directory, layers)
    return model
