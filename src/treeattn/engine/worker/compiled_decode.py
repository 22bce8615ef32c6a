"""A decode step of a packed Llama-family model on the CPU through compiled segments, applied from outside the model.

    decoder = compiled_decode(model, cache)          # RankRunner: once per engine; None where it does not apply
    hidden = decoder.forward(batch)                   # (T, hidden) as model(...)[0] gives it, or None: run the model

The model's modules run a decode step's layer as a dozen small calls (norms, the fused q/k/v product, RoPE, the
cache write, the attention, o_proj, the residual adds, the fused gate/up product, silu * up, down_proj), each a few
microseconds of Python and dispatch around a few of work. CompiledDecode runs the same kernels on the same arrays
with three calls a layer: the attention (the paged CPU kernel over the cache's blocks; on several ranks its
combine across them, PagedBatch's), treeattn.ops.decode_layer_cpu.mlp_input (o_proj, residual add, RMSNorm, gate/up),
torch's silu(gate) * up, and mlp_output (down_proj, residual add, the next layer's RMSNorm, q/k/v, RoPE, the cache
write; the last layer's final_output ends with the model's norm). Its buffers are made once per row count. The
hidden states are the module path's bit for bit (tests/test_compiled_decode.py): float32 and int8 activations.

What it takes (compiled_decode returns None otherwise, with fallback_reason saying why): a LlamaModel of plain
DecoderLayers (Llama, Qwen2 without biases, SmolLM2: Attention, MLP and RMSNorm exactly, no sliding window), float32
on the CPU, every layer's q/k/v and gate/up fused packed matrices (models.packed.fuse_projections) and o_proj and
down_proj PackedLinear, no biases; numba; a paged cache of float32, float16 or bfloat16 with values of their own; not
the Helix layout (--tp: its all-reduces between the products run in the modules). Per step (forward returns None
and the runner runs the model): a step of one group of decoding rows in order, read by the paged kernel, no shared
prefix segments, at most packed_linear.MAX_KERNEL_ROWS rows; with several torch threads, no o_proj or down_proj
large enough for the parallel kernel (packed_linear.PARALLEL_MIN_WEIGHTS). Gemma 3 (its extra norms, GELU, q/k
norms, window layers), DeepSeek, hybrid linear models and fp8 caches take the module path.
"""

from __future__ import annotations

import time

import numpy as np
import torch
import torch.nn.functional as F

from treeattn.models.llama import MLP, Attention, DecoderLayer, LlamaModel, RMSNorm, rope_cos_sin
from treeattn.models.packed import FusedPacked, PackedLinear
from treeattn.ops.kernels import optional_kernel
from treeattn.ops.packed_linear import MAX_KERNEL_ROWS, PARALLEL_MIN_WEIGHTS, int8_module
from treeattn.ops.paged_decode import layer_call

ARENA_BITS = {torch.float32: torch.float32, torch.float16: torch.int16, torch.bfloat16: torch.uint16}
"""The cache dtypes the segments write, and the dtype the compiled code sees their elements as."""


def fallback_reason(model, cache, *, tensor_parallel: bool = False) -> str | None:
    """Why compiled_decode does not apply to `model` and `cache` (a PagedKVCache), or None when it does.

    >>> import treeattn as ta
    >>> from treeattn.cache.paged import PagedKVCache
    >>> from treeattn.models.llama import random_model
    >>> config = ta.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
    ...                         head_dim=8)
    >>> cache = PagedKVCache(num_layers=2, num_kv_heads=2, head_dim=8, num_blocks=2, block_size=4)
    >>> fallback_reason(random_model(config), cache)     # float32 nn.Linear layers: the modules run
    "layer 0: Attention's projections are not one fused packed matrix"
    >>> compiled_decode(random_model(config), cache) is None
    True
    """
    if optional_kernel("rowwise_cpu_kernel") is None or optional_kernel("packed_cpu_kernel") is None:
        return "numba is not installed"
    if tensor_parallel:
        return "the Helix layout (--tp): its all-reduces run between the modules' products"
    if type(model) is not LlamaModel or type(model.norm) is not RMSNorm:
        return f"{type(model).__name__} is not a plain LlamaModel"
    if model.dtype != torch.float32 or model.device.type != "cpu":
        return f"the model is {model.dtype} on {model.device}, not float32 on the CPU"
    if any(w is not None for w in model.config.layer_windows):
        return "sliding-window layers"
    if cache.dtype not in ARENA_BITS or cache.value_dim is not None or cache.num_layers != len(model.layers):
        return f"a {cache.dtype} cache (value_dim {cache.value_dim}): the segments write float32, float16 and bfloat16"
    for i, layer in enumerate(model.layers):
        why = _layer_reason(layer)
        if why is not None:
            return f"layer {i}: {why}"
    return None


def _layer_reason(layer) -> str | None:
    """Why a decoder layer is not one the segments run, or None."""
    if (type(layer) is not DecoderLayer or type(layer.self_attn) is not Attention or type(layer.mlp) is not MLP
            or type(layer.input_layernorm) is not RMSNorm or type(layer.post_attention_layernorm) is not RMSNorm):
        return f"{type(layer).__name__} is not a plain DecoderLayer"
    attn, mlp = layer.self_attn, layer.mlp
    for module in (attn, mlp):
        fused = module.__dict__.get("fused")
        if not isinstance(fused, FusedPacked) or not fused.current():
            return f"{type(module).__name__}'s projections are not one fused packed matrix"
        if any(p.bias is not None for p in fused.parts):
            return "biases on the fused projections"
    for linear in (attn.o_proj, mlp.down_proj):
        if type(linear) is not PackedLinear or linear.bias is not None or linear.qs.device.type != "cpu":
            return "o_proj or down_proj is not a packed CPU matrix without bias"
    return None


def _matrix(linear: PackedLinear) -> tuple:
    """(code, values as uint8 bytes, d, m) of a packed layer, as decode_layer_cpu takes a matrix."""
    from treeattn.ops.decode_layer_cpu import FORMAT_CODES

    qs, d, m = linear._cached().arrays
    return FORMAT_CODES[(linear.fmt, str(qs.dtype))], qs.view(np.uint8), d, m


def compiled_decode(model, cache, *, tensor_parallel: bool = False) -> CompiledDecode | None:
    """A CompiledDecode of `model` over `cache`, or None where fallback_reason gives a reason."""
    if fallback_reason(model, cache, tensor_parallel=tensor_parallel) is not None:
        return None
    return CompiledDecode(model, cache)


class _Buffers:
    """The arrays of a step of `rows` rows (numpy, C-contiguous) and the torch views silu * up reads and writes."""

    def __init__(self, rows: int, c, qkv_rows: int, inter: int) -> None:
        D, hd = c.hidden_size, c.head_dim
        self.h, self.xn, self.o_out, self.down_out, self.out = (np.empty((rows, D), np.float32) for _ in range(5))
        self.qkv_out = np.empty((rows, qkv_rows), np.float32)
        self.q = np.empty((rows, c.num_heads, hd), np.float32)
        self.k = np.empty((rows, c.num_kv_heads, hd), np.float32)
        self.attn = np.empty((rows, c.num_heads * hd), np.float32)
        self.lse = np.empty((rows, c.num_kv_heads, c.num_heads // c.num_kv_heads), np.float32)
        # gate/up as FusedPacked gives them to the module path: slices of one (1, rows, 2 I) product
        self.gate_up = np.empty((1, rows, 2 * inter), np.float32)
        self.gate, self.up = torch.from_numpy(self.gate_up[..., :inter]), torch.from_numpy(self.gate_up[..., inter:])
        self.act = np.empty((1, rows, inter), np.float32)
        self.act_t = torch.from_numpy(self.act)


class CompiledDecode:
    """The compiled segments' decode step for one model and cache (see the module doc); build it with compiled_decode."""

    def __init__(self, model: LlamaModel, cache) -> None:
        from treeattn.ops import decode_layer_cpu as segments

        self.model, self.cache, self.segments = model, cache, segments
        self.config = model.config
        layers = model.layers
        self.qkv = [_matrix(layer.self_attn.fused.whole) for layer in layers]
        self.o = [_matrix(layer.self_attn.o_proj) for layer in layers]
        self.gate_up = [_matrix(layer.mlp.fused.whole) for layer in layers]
        self.down = [_matrix(layer.mlp.down_proj) for layer in layers]
        self.norms = [(n.weight.detach().numpy(), float(n.eps)) for layer in layers
                      for n in (layer.input_layernorm, layer.post_attention_layernorm)]
        self.final_norm = (model.norm.weight.detach().numpy(), float(model.norm.eps))
        self.inter = layers[0].mlp.down_proj.columns
        self.qkv_rows = layers[0].self_attn.fused.whole.rows
        self.parallel_sized = any(m.rows * m.columns >= PARALLEL_MIN_WEIGHTS for layer in layers
                                  for m in (layer.self_attn.o_proj, layer.mlp.down_proj))
        self.arena = cache.arena.view(ARENA_BITS[cache.dtype]).numpy()  # (layers, 2, blocks, block size, Hkv, D)
        self.blocks = [(self.arena[i, 0], self.arena[i, 1]) for i in range(len(layers))]  # what LayerCall's views are
        self.no_scales = optional_kernel("paged_cpu_kernel").NO_SCALES
        self._buffers: dict[int, _Buffers] = {}

    def mode(self) -> tuple:
        """decode_layer_cpu's mode for the model's packed layers now: INT8 where they multiply int8 activations."""
        int8 = self.model.layers[0].self_attn.o_proj.activations == "int8" and int8_module() is not None
        return self.segments.INT8 if int8 else self.segments.FLOAT32

    def forward(self, batch) -> torch.Tensor | None:
        """The step's final hidden states (T, hidden_size), the model's, for a PagedBatch of the kind the module doc
        names; None for any other step (nothing done: the caller runs the model)."""
        group = batch.paged_decode_group()
        T = batch.tokens.shape[1]
        if group is None or T > MAX_KERNEL_ROWS or (self.parallel_sized and torch.get_num_threads() > 1):
            return None
        buf = self._buffers.get(T)
        if buf is None:
            buf = self._buffers[T] = _Buffers(T, self.config, self.qkv_rows, self.inter)
        B, S = group.q_index.shape
        q_t = torch.from_numpy(buf.q).view(B, S, *buf.q.shape[1:])
        k0, v0 = self.cache.blocks(0)
        call = layer_call(q_t, k0, v0, group.paged, views=self.cache.kernel_views)
        if call is None:
            return None
        model, seg, mode = self.model, self.segments, self.mode()
        h = model.embed_tokens(batch.tokens).to(model.dtype).reshape(T, -1)
        buf.h[:] = h.numpy()
        cos, sin = (t.reshape(T, -1).numpy() for t in rope_cos_sin(model.inv_freq, batch.positions, model.dtype))
        rows, slots = batch.store_rows.numpy(), batch.store_slots.numpy()
        w, eps = self.norms[0]
        seg.attention_input(mode, buf.h, w, eps, buf.xn, self.qkv[0], buf.qkv_out, cos, sin, buf.q, buf.k, self.arena, 0,
                            rows, slots)
        last = len(self.o) - 1
        for i in range(last + 1):
            attn = self._attend(batch, call, buf, q_t, i)
            w, eps = self.norms[2 * i + 1]
            seg.mlp_input(mode, attn, self.o[i], buf.o_out, buf.h, w, eps, buf.xn, self.gate_up[i], buf.gate_up[0])
            torch.mul(F.silu(buf.gate), buf.up, out=buf.act_t)
            if i < last:
                w, eps = self.norms[2 * i + 2]
                seg.mlp_output(mode, buf.act[0], self.down[i], buf.down_out, buf.h, w, eps, buf.xn, self.qkv[i + 1],
                               buf.qkv_out, cos, sin, buf.q, buf.k, self.arena, i + 1, rows, slots)
            else:
                seg.final_output(mode, buf.act[0], self.down[i], buf.down_out, buf.h, *self.final_norm, buf.out)
        return torch.from_numpy(buf.out.copy())

    def _attend(self, batch, call, buf: _Buffers, q_t: torch.Tensor, layer: int) -> np.ndarray:
        """Layer `layer`'s attention of buf.q over this rank's blocks, combined across the ranks where there are
        several (PagedBatch.combine_state): (rows, Hq * head_dim) float32, C-contiguous. Its seconds go to the
        batch's phases as PagedBatch.attend counts them ("attention"; the combine's own "combine")."""
        start = time.perf_counter()
        if batch.combine_size() == 1:  # the kernel's entry on the buffers: LayerCall's call, without its torch views
            table, kv_pos, row_seq, q_pos, splits = call.arrays
            k, v = self.blocks[layer]
            call.entry(buf.q.reshape(call.rows), k, v, self.no_scales, self.no_scales, call.Dv, call.scale, table, kv_pos,
                       row_seq, q_pos, 0, splits, buf.attn.reshape(call.out_shape), buf.lse)
            batch.phases["attention"] = batch.phases.get("attention", 0.0) + time.perf_counter() - start
            return buf.attn
        combined = batch.phases.get("combine", 0.0)
        k, v = self.cache.blocks(layer)
        out = batch.combine_state(*call(q_t, k, v, None))
        local = time.perf_counter() - start - (batch.phases.get("combine", 0.0) - combined)
        batch.phases["attention"] = batch.phases.get("attention", 0.0) + local
        return np.ascontiguousarray(out.numpy()).reshape(buf.attn.shape)


__all__ = ["ARENA_BITS", "CompiledDecode", "compiled_decode", "fallback_reason"]
