"""A decode step of a packed Llama-family or Gemma 3 model on the CPU through compiled segments, applied from outside the model.

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

Gemma 3 (GemmaCompiledDecode, decode_layer_cpu's gemma_* segments): the same three calls a layer with Gemma's four
norms (1 + weight), q_norm / k_norm per head, the query factor, GELU-tanh(gate) * up (torch's) and its two rope tables
(window layers rope_local_theta's); the embedding times sqrt(hidden_size) stays torch's, as the logits' soft-capping
(model.logits, after the step). Its global layers attend as above. Its window layers keep the hybrid cache's rings
(treeattn.cache.window: replicated, no combine): when every sequence decodes one row, decode_layer_cpu.window_store
writes the ring row WindowKVCache.decode_row marks and the CPU decode kernel runs on the rings as
ops.cpu_decode.decode_attention runs it for the batch (_WindowStep); with drafts, the batch's own kv_store and attend
(the module path's calls on the same tensors). Either way the ring is written where the module path writes it.

What it takes (compiled_decode returns None otherwise, with fallback_reason saying why): a LlamaModel of plain
DecoderLayers (Llama, Qwen2 without biases, SmolLM2: Attention, MLP and RMSNorm exactly, no sliding window) or a
Gemma3Model of plain Gemma 3 layers (window and global layers, at least one global; one norm epsilon), float32
on the CPU, every layer's q/k/v and gate/up fused packed matrices (models.packed.fuse_projections) and o_proj and
down_proj PackedLinear, no biases; numba; a paged cache of float32, float16 or bfloat16 with values of their own. In
the Helix layout (--tp) a Llama-family model runs HelixCompiledDecode (the all-reduces between the segments); Gemma 3
there takes the module path. Per step (forward returns None
and the runner runs the model): a step of one group of decoding rows in order, read by the paged kernel, no shared
prefix segments, at most packed_linear.MAX_KERNEL_ROWS rows; with several torch threads, no o_proj or down_proj
large enough for the parallel kernel (packed_linear.PARALLEL_MIN_WEIGHTS). DeepSeek, hybrid linear models,
sliding-window Llama-family models (Mistral) and fp8 caches take the module path.
"""

from __future__ import annotations

import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from treeattn.cache.window import paged_layers
from treeattn.models.gemma3 import Gemma3Attention, Gemma3DecoderLayer, Gemma3MLP, Gemma3Model, Gemma3RMSNorm
from treeattn.models.llama import MLP, Attention, DecoderLayer, LlamaModel, RMSNorm, rope_cos_sin
from treeattn.models.packed import FusedPacked, PackedLinear
from treeattn.ops.cpu_decode import contiguous_layout
from treeattn.ops.kernels import optional_kernel
from treeattn.ops.packed_linear import MAX_KERNEL_ROWS, PARALLEL_MIN_WEIGHTS, int8_module
from treeattn.ops.paged_decode import layer_call
from treeattn.parallel import comm

ARENA_BITS = {torch.float32: torch.float32, torch.float16: torch.int16, torch.bfloat16: torch.uint16}
"""The cache dtypes the segments write, and the dtype the compiled code sees their elements as."""
GEMMA_NORMS = ("pre_feedforward_layernorm", "post_feedforward_layernorm")
"""A Gemma 3 layer's norms beside Llama's two."""


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
    gemma = type(model) is Gemma3Model
    if tensor_parallel and (gemma or getattr(model, "helix_sums", None) is None):
        return ("Gemma 3 in the Helix layout (--tp)" if gemma
                else "the Helix layout (--tp) without the groups its sums run over (tensor_parallel.connect sets them)")
    if not gemma and (type(model) is not LlamaModel or type(model.norm) is not RMSNorm):
        return f"{type(model).__name__} is not a plain LlamaModel or a Gemma3Model"
    if model.dtype != torch.float32 or model.device.type != "cpu":
        return f"the model is {model.dtype} on {model.device}, not float32 on the CPU"
    windows = model.config.layer_windows
    if not gemma and any(w is not None for w in windows):
        return "sliding-window layers"
    if gemma and windows and all(w is not None for w in windows):
        return "every layer slides (no global layer: the paged cache holds the window layers)"
    if cache.dtype not in ARENA_BITS or cache.value_dim is not None:
        return f"a {cache.dtype} cache (value_dim {cache.value_dim}): the segments write float32, float16 and bfloat16"
    if cache.num_layers != len(paged_layers(windows)):
        return f"a paged cache of {cache.num_layers} layers for the model's {len(paged_layers(windows))} paged layers"
    for i, layer in enumerate(model.layers):
        why = _layer_reason(layer, gemma)
        if why is not None:
            return f"layer {i}: {why}"
    if gemma and any(float(n.eps) != float(model.norm.eps) for layer in model.layers for n in _gemma_norms(layer)):
        return "norms of different epsilons (the Gemma segments take one)"
    return None


def _layer_reason(layer, gemma: bool) -> str | None:
    """Why a decoder layer is not one the segments run (Llama's, or with `gemma` Gemma 3's), or None."""
    kinds = (Gemma3DecoderLayer, Gemma3Attention, Gemma3MLP, Gemma3RMSNorm) if gemma else (DecoderLayer, Attention, MLP, RMSNorm)
    norms = ("input_layernorm", "post_attention_layernorm") + (GEMMA_NORMS if gemma else ())
    if (type(layer) is not kinds[0] or type(layer.self_attn) is not kinds[1] or type(layer.mlp) is not kinds[2]
            or any(type(getattr(layer, n)) is not kinds[3] for n in norms)):
        return f"{type(layer).__name__} is not a plain {kinds[0].__name__}"
    attn, mlp = layer.self_attn, layer.mlp
    if gemma and (type(attn.q_norm) is not Gemma3RMSNorm or type(attn.k_norm) is not Gemma3RMSNorm):
        return "q_norm or k_norm is not a Gemma3RMSNorm"
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
    if tensor_parallel:
        return HelixCompiledDecode(model, cache, *model.helix_sums)
    return GemmaCompiledDecode(model, cache) if type(model) is Gemma3Model else CompiledDecode(model, cache)


class _Buffers:
    """The arrays of a step of `rows` rows (numpy, C-contiguous) and the torch views silu * up reads and writes; with
    `gemma`, Gemma 3's too: post (the post-attention and post-feedforward norms' rows), heads (q_norm and k_norm's rows
    and results: gemma_attention_input's scratch) and the torch views of q, k and v a window layer's batch calls take."""

    def __init__(self, rows: int, c, heads: tuple[int, int], qkv_rows: int, inter: int, gemma: bool = False) -> None:
        (Hq, Hkv), D, hd = heads, c.hidden_size, c.head_dim  # heads: the layer's own (a Helix rank's share)
        self.h, self.xn, self.o_out, self.down_out, self.out = (np.empty((rows, D), np.float32) for _ in range(5))
        self.qkv_out = np.empty((rows, qkv_rows), np.float32)
        self.q = np.empty((rows, Hq, hd), np.float32)
        self.k = np.empty((rows, Hkv, hd), np.float32)
        self.attn = np.empty((rows, Hq * hd), np.float32)
        self.lse = np.empty((rows, Hkv, Hq // Hkv), np.float32)
        # gate/up as FusedPacked gives them to the module path: slices of one (1, rows, 2 I) product
        self.gate_up = np.empty((1, rows, 2 * inter), np.float32)
        self.gate, self.up = torch.from_numpy(self.gate_up[..., :inter]), torch.from_numpy(self.gate_up[..., inter:])
        self.act = np.empty((1, rows, inter), np.float32)
        self.act_t = torch.from_numpy(self.act)
        if gemma:
            self.post = np.empty((rows, D), np.float32)
            self.heads = (np.empty((rows * Hq, hd), np.float32), np.empty((rows, Hq * hd), np.float32),
                          np.empty((rows * Hkv, hd), np.float32), np.empty((rows, Hkv * hd), np.float32))
            self.q_t, self.k_t = torch.from_numpy(self.q)[None], torch.from_numpy(self.k)[None]
            v0 = (Hq + Hkv) * hd  # the values: the fused product's last columns, as the module path views them
            self.v_t = torch.from_numpy(self.qkv_out)[None, :, v0:].view(1, rows, Hkv, hd)


class CompiledDecode:
    """The compiled segments' decode step for one model and cache (see the module doc); build it with compiled_decode."""

    gemma = False  # GemmaCompiledDecode: Gemma 3's buffers and segments
    o_group = mlp_group = None  # HelixCompiledDecode: the groups o_proj's and down_proj's partial sums run over

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
        self.heads = (layers[0].self_attn.num_heads, layers[0].self_attn.num_kv_heads)
        self.parallel_sized = any(m.rows * m.columns >= PARALLEL_MIN_WEIGHTS for layer in layers
                                  for m in (layer.self_attn.o_proj, layer.mlp.down_proj))
        # model layer -> its layer in the paged cache (a hybrid cache's window layers have none)
        self.paged_index = {layer: i for i, layer in enumerate(paged_layers(self.config.layer_windows))}
        self.arena = cache.arena.view(ARENA_BITS[cache.dtype]).numpy()  # (layers, 2, blocks, block size, Hkv, D)
        self.blocks = [(self.arena[i, 0], self.arena[i, 1]) for i in range(cache.num_layers)]  # what LayerCall's views are
        self.no_scales = optional_kernel("paged_cpu_kernel").NO_SCALES
        self._buffers: dict[int, _Buffers] = {}

    def mode(self) -> tuple:
        """decode_layer_cpu's mode for the model's packed layers now: INT8 where they multiply int8 activations."""
        int8 = self.model.layers[0].self_attn.o_proj.activations == "int8" and int8_module() is not None
        return self.segments.INT8 if int8 else self.segments.FLOAT32

    def _prepare(self, batch) -> tuple | None:
        """(the step's buffers, its queries as the paged kernel's torch view, the paged kernel's LayerCall) for a step
        the segments run; None for any other (nothing done)."""
        group = batch.paged_decode_group(windows=self.gemma)
        T = batch.tokens.shape[1]
        if group is None or T > MAX_KERNEL_ROWS or (self.parallel_sized and torch.get_num_threads() > 1):
            return None
        buf = self._buffers.get(T)
        if buf is None:
            buf = self._buffers[T] = _Buffers(T, self.config, self.heads, self.qkv_rows, self.inter, self.gemma)
        B, S = group.q_index.shape
        q_t = torch.from_numpy(buf.q).view(B, S, *buf.q.shape[1:])
        k0, v0 = self.cache.blocks(0)
        call = layer_call(q_t, k0, v0, group.paged, views=self.cache.kernel_views)
        return None if call is None else (buf, q_t, call)

    def forward(self, batch) -> torch.Tensor | None:
        """The step's final hidden states (T, hidden_size), the model's, for a PagedBatch of the kind the module doc
        names; None for any other step (nothing done: the caller runs the model)."""
        prepared = self._prepare(batch)
        if prepared is None:
            return None
        buf, q_t, call = prepared
        seg, mode = self.segments, self.mode()
        cos, sin, rows, slots = self._inputs(batch, buf)
        w, eps = self.norms[0]
        seg.attention_input(mode, buf.h, w, eps, buf.xn, self.qkv[0], buf.qkv_out, cos, sin, buf.q, buf.k, self.arena, 0,
                            rows, slots)
        last = len(self.o) - 1
        for i in range(last + 1):
            attn = self._attend(batch, call, buf, q_t, i)
            w, eps = self.norms[2 * i + 1]
            if self.o_group is None:
                seg.mlp_input(mode, attn, self.o[i], buf.o_out, buf.h, w, eps, buf.xn, self.gate_up[i], buf.gate_up[0])
            else:  # the Helix layout with tp > 1 (HelixCompiledDecode): o_proj's partial sums all-reduced between
                seg.product(mode, attn, self.o[i], buf.o_out)
                _sum(buf.o_out, self.o_group)
                seg.norm_gate_up(mode, buf.o_out, buf.h, w, eps, buf.xn, self.gate_up[i], buf.gate_up[0])
            torch.mul(F.silu(buf.gate), buf.up, out=buf.act_t)
            if self.mlp_group is not None:  # the Helix layout: down_proj's partial sums all-reduced, then the rest
                seg.product(mode, buf.act[0], self.down[i], buf.down_out)
                _sum(buf.down_out, self.mlp_group)
            if i < last:
                w, eps = self.norms[2 * i + 2]
                attention = (self.qkv[i + 1], buf.qkv_out, cos, sin, buf.q, buf.k, self.arena, i + 1, rows, slots)
                if self.mlp_group is None:
                    seg.mlp_output(mode, buf.act[0], self.down[i], buf.down_out, buf.h, w, eps, buf.xn, *attention)
                else:
                    seg.residual_attention_input(mode, buf.down_out, buf.h, w, eps, buf.xn, *attention)
            elif self.mlp_group is None:
                seg.final_output(mode, buf.act[0], self.down[i], buf.down_out, buf.h, *self.final_norm, buf.out)
            else:
                seg.residual_final_norm(buf.down_out, buf.h, *self.final_norm, buf.out)
        return torch.from_numpy(buf.out.copy())

    def _inputs(self, batch, buf: _Buffers) -> tuple[np.ndarray, ...]:
        """The step's embedded rows into buf.h (the model's embedding, as LlamaModel.forward takes them), and (cos, sin,
        the cache rows, their slots) as the segments take them."""
        T, model = batch.tokens.shape[1], self.model
        buf.h[:] = model.embed_tokens(batch.tokens).to(model.dtype).reshape(T, -1).numpy()
        cos, sin = (t.reshape(T, -1).numpy() for t in rope_cos_sin(model.inv_freq, batch.positions, model.dtype))
        return cos, sin, batch.store_rows.numpy(), batch.store_slots.numpy()

    def _attend(self, batch, call, buf: _Buffers, q_t: torch.Tensor, layer: int) -> np.ndarray:
        """The paged cache's layer `layer`'s attention of buf.q over this rank's blocks, combined across the ranks where
        there are several (PagedBatch.combine_state): (rows, Hq * head_dim) float32, C-contiguous. Its seconds go to
        the batch's phases as PagedBatch.attend counts them ("attention"; the combine's own "combine")."""
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


class GemmaCompiledDecode(CompiledDecode):
    """Gemma 3's decode step through decode_layer_cpu's gemma_* segments (see the module doc): per layer the attention,
    gemma_mlp_input, torch's gelu_tanh(gate) * up, gemma_mlp_output (or gemma_final_output). A global layer attends
    as CompiledDecode's layers do (its keys and values written into the paged arena by the segment); a window layer's
    keys and values go to the hybrid cache's window rings, through _WindowStep where every sequence decodes one row,
    else through the batch's own kv_store and attend (WindowKVCache.extend, ops.attention), as the module path."""

    gemma = True

    def __init__(self, model: Gemma3Model, cache) -> None:
        super().__init__(model, cache)
        self.norms = [tuple(n.weight.detach().numpy() for n in _gemma_norms(layer)) for layer in model.layers]
        self.eps = float(model.norm.eps)  # every norm's (fallback_reason)
        self.factors = [1.0 if layer.self_attn.query_factor is None else float(layer.self_attn.query_factor)
                        for layer in model.layers]
        self.windows = [layer.self_attn.window for layer in model.layers]
        self.no_rows = np.empty(0, np.int64)  # a window layer's paged-cache rows: none

    def forward(self, batch) -> torch.Tensor | None:
        """As CompiledDecode.forward, for Gemma 3."""
        prepared = self._prepare(batch)
        if prepared is None:
            return None
        buf, q_t, call = prepared
        T = batch.tokens.shape[1]
        model, seg, mode, eps = self.model, self.segments, self.mode(), self.eps
        h = model.embed_tokens(batch.tokens).to(model.dtype)
        h = h * torch.tensor(self.config.hidden_size ** 0.5, dtype=h.dtype, device=h.device)  # Gemma3Model.forward's
        buf.h[:] = h.reshape(T, -1).numpy()
        tables = [tuple(t.reshape(T, -1).numpy() for t in rope_cos_sin(inv, batch.positions, model.dtype))
                  for inv in (model.inv_freq, model.inv_freq_local)]  # global layers', window layers'
        stores = (batch.store_rows.numpy(), batch.store_slots.numpy())
        window_step = _WindowStep.of(batch, q_t.shape, self.config, self.segments)
        seg.gemma_attention_input(mode, buf.h, self.norms[0], eps, buf.xn, *self._attention_args(0, buf, tables, stores))
        last = len(self.o) - 1
        for i in range(last + 1):
            if self.windows[i] is None:
                attn = self._attend(batch, call, buf, q_t, self.paged_index[i])
            else:
                attn = self._attend_window(batch, buf, i, window_step)
            seg.gemma_mlp_input(mode, attn, self.o[i], buf.o_out, buf.h, self.norms[i], eps, buf.post, buf.xn,
                                self.gate_up[i], buf.gate_up[0])
            torch.mul(F.gelu(buf.gate, approximate="tanh"), buf.up, out=buf.act_t)
            if i < last:
                seg.gemma_mlp_output(mode, buf.act[0], self.down[i], buf.down_out, buf.h, self.norms[i], eps, buf.post,
                                     buf.xn, self.norms[i + 1], *self._attention_args(i + 1, buf, tables, stores))
            else:
                seg.gemma_final_output(mode, buf.act[0], self.down[i], buf.down_out, buf.h, self.norms[i], eps, buf.post,
                                       *self.final_norm, buf.out)
        return torch.from_numpy(buf.out.copy())

    def _attention_args(self, layer: int, buf: _Buffers, tables, stores) -> tuple:
        """gemma_attention_input's arguments after xn for model layer `layer`: its rope table and, for a global layer,
        its paged-cache layer and the step's rows and slots (a window layer: no rows; the batch writes its ring)."""
        window = self.windows[layer] is not None
        rows, slots = (self.no_rows, self.no_rows) if window else stores
        return (self.qkv[layer], buf.qkv_out, buf.heads, *tables[window], self.factors[layer], buf.q, buf.k, self.arena,
                self.paged_index.get(layer, 0), rows, slots)

    def _attend_window(self, batch, buf: _Buffers, layer: int, step: _WindowStep | None) -> np.ndarray:
        """Window layer `layer`: its new keys and values into the window rings and its attention over them (every rank
        alone, no combine): through `step` where it takes the layer, else through the batch's kv_store and attend as
        the module path calls them. Returns (rows, Hq * head_dim) float32, C-contiguous."""
        if step is not None and step.attend(layer, self.windows[layer], buf):
            return buf.attn
        k, v, kv_pos = batch.kv_store(layer, buf.k_t, buf.v_t)
        out = batch.attend(buf.q_t, k, v, q_pos=batch.positions, kv_pos=kv_pos, window=self.windows[layer])
        return np.ascontiguousarray(out.numpy()).reshape(buf.attn.shape)


class HelixCompiledDecode(CompiledDecode):
    """The Helix layout's decode step (--tp; engine.worker.tensor_parallel.connect): CompiledDecode's, with the segments
    cut where the modules' hooks all-reduce: o_proj's partial sums over `o_group` (the TP group; None for tp = 1,
    whose o_proj is whole on every rank) and down_proj's over `mlp_group` (every rank), each summed by the same
    comm.all_reduce on the same rows as the hook, between two compiled calls (decode_layer_cpu.product, then
    norm_gate_up / residual_attention_input / residual_final_norm). A rank runs its own heads (their attention
    combined over its KV group, as CompiledDecode's) and its share of the MLP; the embedding is the model's
    (VocabParallelEmbedding: its own all-reduce). The hidden states are the module path's bit for bit. CompiledDecode's
    forward runs it: this class only holds the groups."""

    def __init__(self, model: LlamaModel, cache, o_group, mlp_group) -> None:
        super().__init__(model, cache)
        self.o_group, self.mlp_group = o_group, mlp_group


def _sum(rows: np.ndarray, group) -> None:
    """rows (numpy, C-contiguous) all-reduced (sum) over `group` in place, as tensor_parallel's hook sums a module's output."""
    t = torch.from_numpy(rows)
    out = comm.all_reduce(t, dist.ReduceOp.SUM, group)
    if out.data_ptr() != t.data_ptr():
        t.copy_(out)


class _WindowStep:
    """A decode step's window layers when every sequence decodes one row: each ring row written by
    decode_layer_cpu.window_store (WindowKVCache.decode_row marks it) and the CPU decode kernel's entry called on the
    rings as ops.cpu_decode.decode_attention calls it for the batch's attend (its blocks, table, positions, splits,
    threads and scale; several sequences' rings stacked as the batch stacks them), with none of their torch calls. The
    same values written, the same kernel on the same arrays: the module path's bits."""

    def __init__(self, batch, B: int, config, segments) -> None:
        self.batch, self.segments = batch, segments
        self.members = [(c.seq_id, c.start) for c in batch.chunks]
        self.like = {torch.float32: np.float32(0), torch.float16: np.int16(0), torch.bfloat16: np.uint16(0)}[batch.windows.dtype]
        Hq, Hkv, D = config.num_heads, config.num_kv_heads, config.head_dim
        self.heads = (Hkv, Hq // Hkv, D, D)
        self.scale, self.v0, self.B = D ** -0.5, (Hq + Hkv) * D, B
        self.q_pos = batch.positions.reshape(-1).numpy()
        self.row_seq = np.arange(B, dtype=np.int64)
        self.shapes = (B, Hkv, Hq // Hkv, D), (B, Hkv, Hq // Hkv)
        self._layouts: dict[int, tuple] = {}  # ring size -> (block, blocks, table, splits, the kernel's entry)

    @classmethod
    def of(cls, batch, q_shape, config, segments) -> _WindowStep | None:
        """The step's _WindowStep, or None where a sequence decodes several rows (drafts: the batch's attend) or the
        window cache is not held in float32 of float32, float16 or bfloat16."""
        windows = batch.windows
        if windows is None or q_shape[1] != 1 or windows.dtype not in ARENA_BITS or windows.compute_dtype != torch.float32:
            return None
        return cls(batch, q_shape[0], config, segments)

    def attend(self, layer: int, window: int, buf: _Buffers) -> bool:
        """Window layer `layer`'s new keys and values (buf.k, buf.qkv_out) into the rings and its attention of buf.q over
        them into buf.attn; False (nothing written) where a ring is not one decode_row takes."""
        start = time.perf_counter()
        rings = []
        for seq_id, position in self.members:
            ring = self.batch.windows.decode_row(layer, seq_id, position)
            if ring is None:
                return False
            rings.append(ring)
        for b, (k, v, _, at) in enumerate(rings):
            self.segments.window_store(buf.k, buf.qkv_out, self.v0, b, k.numpy(), v.numpy(), at, self.like)
        size = rings[0][0].shape[0]
        layout = self._layouts.get(size)
        if layout is None:  # decode_attention's choices for these rings (cpu_decode.contiguous_layout)
            block, nb, table, threads, splits = contiguous_layout(self.B, 1, size)
            entry = optional_kernel("paged_cpu_kernel").entry(threads, *self.heads)
            layout = self._layouts[size] = (block, nb, table, splits, entry)
        block, nb, table, splits, entry = layout
        if self.B == 1:
            k, v, pos = (t.numpy() for t in rings[0][:3])
            k, v, kv_pos = k.reshape(nb, block, *k.shape[1:]), v.reshape(nb, block, *v.shape[1:]), pos.reshape(1, -1)
        else:  # the rings stacked, as the batch's _window_store stacks them
            k, v, kv_pos = (torch.stack([ring[i] for ring in rings]).numpy() for i in range(3))
            k, v = k.reshape(self.B * nb, block, *k.shape[2:]), v.reshape(self.B * nb, block, *v.shape[2:])
        no_scales = optional_kernel("paged_cpu_kernel").NO_SCALES
        entry(buf.q.reshape(self.shapes[0]), k, v, no_scales, no_scales, k.shape[-1], self.scale, table, kv_pos,
                   self.row_seq, self.q_pos, window, splits, buf.attn.reshape(self.shapes[0]), buf.lse)
        self.batch.phases["attention"] = self.batch.phases.get("attention", 0.0) + time.perf_counter() - start
        return True


def _gemma_norms(layer) -> tuple:
    """A Gemma 3 layer's norms in decode_layer_cpu's order: input, post-attention, pre- and post-feedforward, q, k."""
    return (layer.input_layernorm, layer.post_attention_layernorm, layer.pre_feedforward_layernorm,
            layer.post_feedforward_layernorm, layer.self_attn.q_norm, layer.self_attn.k_norm)


__all__ = ["ARENA_BITS", "CompiledDecode", "GemmaCompiledDecode", "HelixCompiledDecode", "compiled_decode", "fallback_reason"]
