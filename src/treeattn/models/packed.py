"""Layers whose weights stay in a GGUF file's block formats (q4_0, q4_1, q8_0): the loader's weight_format="packed".

    layer = PackedLinear("q4_1", qs, d, m, bias=None)     # replaces an nn.Linear: y = layer(x)
    embed = PackedEmbedding("q8_0", qs, d, None)           # replaces an nn.Embedding: rows = embed(tokens)
    logits = embed.project(hidden)                         # a tied output projection, packed too
    n = weight_bytes(model)                                 # bytes of every parameter and packed buffer
    fuse_projections(model)                                 # q/k/v and gate/up each one matrix for decode calls

The quantized values and the float32 scales (unpack_blocks of treeattn.ops.packed_linear) are
buffers: integer tensors, so `model.to(dtype)` leaves them alone. The scales are kept as their int32
bit patterns (viewed as float32 when used) for the same reason: a float buffer would be rounded by
`model.to(torch.bfloat16)`, and the weights would no longer be the file's.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from treeattn.cache.paged import host_empty
from treeattn.ops.packed_linear import (BLOCK, FORMATS, PARALLEL_MIN_WEIGHTS, dequantize_packed, kernel_arrays, kernel_matmul,
                                        kernel_module, kernel_takes, packed_matmul, resolve_activation_format,
                                        resolve_prefill_dtype)

WEIGHT_FORMATS = ("auto", "dequantize", "packed")
"""How a loader holds a checkpoint's quantized weights: "dequantize" (in the model's dtype), "packed"
(a GGUF file's q4_0/q4_1/q8_0 matrices as these layers; refused for what they cannot keep) or "auto"
(packed what can be on the CPU, the rest dequantized; treeattn.models.gguf)."""


class _Views(NamedTuple):
    """A packed layer's buffers as its calls read them (made once per set of buffers, _Packed._cached)."""

    fmt: str
    qs: torch.Tensor
    d: torch.Tensor  # the scales' int32 bits viewed as float32
    m: torch.Tensor | None
    arrays: tuple | None  # ops.packed_linear.kernel_arrays(qs, d, m); None off the CPU
    d_bits: torch.Tensor  # the buffers the views were made of
    m_bits: torch.Tensor | None


class _Packed(nn.Module):
    """The storage both packed layers share: qs, and d (and m) as int32 bits."""

    def __init__(self, fmt: str, qs: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None) -> None:
        super().__init__()
        if fmt not in FORMATS:
            raise ValueError(f"fmt must be one of {FORMATS}, got {fmt!r}")
        if (m is not None) != (fmt == "q4_1"):
            raise ValueError(f"m (the blocks' offsets) is given exactly for q4_1, got fmt={fmt!r} and "
                             f"m={'a tensor' if m is not None else None}")
        self.fmt = fmt
        self.activations = "float32"  # how decode-sized calls multiply: "float32" or "int8" (set_activation_format)
        self.prefill_dtype = "float32"  # what prefill-sized CPU calls multiply in: "float32" or "bfloat16" (set_prefill_dtype)
        self.register_buffer("qs", qs)
        self.register_buffer("d_bits", d.to(torch.float32).view(torch.int32))
        self.register_buffer("m_bits", None if m is None else m.to(torch.float32).view(torch.int32))

    @property
    def rows(self) -> int:
        return self.qs.shape[0]

    @property
    def columns(self) -> int:
        return self.qs.shape[1] * BLOCK

    def _parts(self):
        """(fmt, qs, d, m) with the scales viewed as float32. Made once per set of buffers (module.to()
        replaces them): a decode step calls every packed layer once, and the views cost about as much
        as a small layer's kernel."""
        views = self._cached()
        return views.fmt, views.qs, views.d, views.m

    def _cached(self) -> _Views:
        """The _Views of the current buffers: rebuilt when a buffer was replaced."""
        qs, d_bits, m_bits = self._buffers["qs"], self._buffers["d_bits"], self._buffers["m_bits"]
        cached = self.__dict__.get("_cached_parts")
        if cached is None or cached.qs is not qs or cached.d_bits is not d_bits or cached.m_bits is not m_bits:
            d, m = d_bits.view(torch.float32), None if m_bits is None else m_bits.view(torch.float32)
            cached = _Views(self.fmt, qs, d, m, kernel_arrays(qs, d, m), d_bits, m_bits)
            self.__dict__["_cached_parts"] = cached
        return cached

    def __getstate__(self):
        state = super().__getstate__().copy()
        state.pop("_cached_parts", None)  # views of the buffers: rebuilt on first use
        return state

    def dequantized(self) -> torch.Tensor:
        """The float32 (rows, columns) weight: the file's float32 dequantization."""
        return dequantize_packed(*self._parts())

    def dequantized_rows(self, rows: torch.Tensor | slice) -> torch.Tensor:
        """The float32 rows `rows` (an int64 index tensor or a slice) of the weight: dequantized()[rows], the same
        values, without dequantizing the others."""
        fmt, qs, d, m = self._parts()
        return dequantize_packed(fmt, qs[rows], d[rows], None if m is None else m[rows])

    def project(self, x: torch.Tensor, rows: slice | None = None) -> torch.Tensor:
        """x (..., columns) @ W.T -> (..., rows) in x.dtype, float32 accumulation; with `rows` (a slice,
        step 1) only those rows of W: the same values as the full product's columns."""
        v = self._cached()
        if rows is None:
            return packed_matmul(x, v.fmt, v.qs, v.d, v.m, arrays=v.arrays, activations=self.activations,
                                 prefill_dtype=self.prefill_dtype)
        arrays = None if v.arrays is None else tuple(a[rows] for a in v.arrays)
        return packed_matmul(x, v.fmt, v.qs[rows], v.d[rows], None if v.m is None else v.m[rows], arrays=arrays,
                             activations=self.activations, prefill_dtype=self.prefill_dtype)

    def extra_repr(self) -> str:
        return f"{self.fmt}, rows={self.rows}, columns={self.columns}"


class PackedLinear(_Packed):
    """nn.Linear(columns, rows) over a packed weight: forward(x (..., columns)) -> (..., rows) in x.dtype."""

    def __init__(self, fmt: str, qs: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None,
                 bias: torch.Tensor | None = None) -> None:
        super().__init__(fmt, qs, d, m)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        v = self._cached()
        return packed_matmul(x, v.fmt, v.qs, v.d, v.m, self.bias, arrays=v.arrays, activations=self.activations,
                             prefill_dtype=self.prefill_dtype)


class PackedEmbedding(_Packed):
    """nn.Embedding(rows, columns) over a packed table: forward(tokens int64 (...)) -> float32 (..., columns),
    only the looked-up rows dequantized."""

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.dequantized_rows(tokens)


class FusedPacked:
    """PackedLinear layers of one format over the same input (q, k, v; gate, up) as one matrix: their rows
    stacked, one kernel call per decode step instead of one per part, the product split back.

    Made by fuse_packed. The parts' buffers become views of the stacked ones (no second copy: the model's
    parameters, state_dict and weight_bytes stay as they were), so each part still works alone. A call is
    bit for bit the parts' own calls: the CPU kernel computes every output row by itself, the stacked call
    runs on one thread as each part did, and each part but the last has a multiple of the kernel's row
    group (packed_cpu_kernel.ROWS), so every row falls in the same group of rows as alone. Calls the kernel
    does not take (prefill-sized, CUDA, autograd), and parts whose buffers were replaced since (module.to(),
    load_state_dict), run the parts one by one.

    Example::

        >>> import numpy as np, torch
        >>> from treeattn.models.packed import PackedLinear, fuse_packed
        >>> def part(rows, seed):
        ...     g = np.random.default_rng(seed)
        ...     qs = torch.from_numpy(g.integers(0, 256, (rows, 2, 16), dtype=np.uint8))
        ...     return PackedLinear("q4_0", qs, torch.from_numpy(g.random((rows, 2), dtype=np.float32)), None)
        >>> q, k = part(8, 0), part(4, 1)
        >>> x = torch.randn(1, 64)
        >>> alone = (q(x), k(x))
        >>> fused = fuse_packed([q, k])
        >>> all(torch.equal(a, b) for a, b in zip(fused(x), alone))
        True
    """

    def __init__(self, parts: list[PackedLinear]) -> None:
        first = parts[0]
        qs = torch.cat([p.qs for p in parts])
        d = torch.cat([p.d_bits for p in parts]).view(torch.float32)
        m = None if first.m_bits is None else torch.cat([p.m_bits for p in parts]).view(torch.float32)
        self.whole = PackedLinear(first.fmt, qs, d, m)
        self.parts = tuple(parts)
        self.bind()

    def bind(self) -> None:
        """Make each part's buffers views of its rows of the stacked ones (again after pack_arena moved them)."""
        self.bounds = []
        start = 0
        for p in self.parts:  # each part keeps a view of its rows of the stacked buffers
            stop = start + p.rows
            p.qs = self.whole.qs[start:stop]
            p.d_bits = self.whole.d_bits[start:stop]
            if self.whole.m_bits is not None:
                p.m_bits = self.whole.m_bits[start:stop]
            p.__dict__.pop("_cached_parts", None)
            self.bounds.append((start, stop))
            start = stop
        self.views = tuple(p.qs for p in self.parts)

    def current(self) -> bool:
        """Whether every part still holds the views made at fusion (module.to() or load_state_dict replace them)."""
        for p, view in zip(self.parts, self.views):  # a loop, not all(generator): called by every decode step's layers
            if p._buffers["qs"] is not view:
                return False
        return True

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(part(x) for every part), bit for bit: x (..., columns) -> one (..., part.rows) tensor per part in x.dtype."""
        if not (kernel_takes(x) and self.current()):
            return tuple(p(x) for p in self.parts)
        v = self.whole._cached()
        out = kernel_matmul(x, v.fmt, v.qs, v.arrays, 1, self.parts[0].activations)  # numpy (..., rows): sliced in numpy
        results = []
        for p, (start, stop) in zip(self.parts, self.bounds):
            y = torch.from_numpy(out[..., start:stop])
            if p.bias is not None:  # as packed_matmul adds a part's bias: in float32, then x's dtype
                y = y + p.bias.to(torch.float32)
            results.append(y if y.dtype == x.dtype else y.to(x.dtype))
        return tuple(results)


def fuse_packed(parts: list[nn.Module]) -> FusedPacked | None:
    """A FusedPacked of `parts`, or None when they cannot be multiplied as one matrix bit for bit: not all
    PackedLinear of one format, value dtype and column count on the CPU, no numba kernel, a part large
    enough for the parallel kernel (PARALLEL_MIN_WEIGHTS), or (4-bit formats) a part before the last whose
    rows are not a multiple of the kernel's row group."""
    kernel = kernel_module()
    if kernel is None or len(parts) < 2 or not all(type(p) is PackedLinear for p in parts):
        return None
    first = parts[0]
    if any(p.fmt != first.fmt or p.columns != first.columns or p.qs.dtype != first.qs.dtype or p.qs.device.type != "cpu"
           or p.rows * p.columns >= PARALLEL_MIN_WEIGHTS for p in parts):
        return None
    if first.fmt != "q8_0" and any(p.rows % kernel.ROWS for p in parts[:-1]):
        return None
    return FusedPacked(list(parts))


def fuse_projections(model: nn.Module) -> int:
    """Fuse every attention's q/k/v_proj and every MLP's gate/up_proj where fuse_packed can (in place; the
    attention and MLP forwards use a module's `fused` attribute, a FusedPacked, while it is current).
    Apply it to the model as it will run: after tensor-parallel sharding (each rank fuses its own rows).
    Returns the number of fusions made."""
    made = 0
    for module in model.modules():
        names = (("q_proj", "k_proj", "v_proj") if hasattr(module, "q_proj") else
                 ("gate_proj", "up_proj") if hasattr(module, "gate_proj") else None)
        if names is None or "fused" in module.__dict__ or not all(isinstance(getattr(module, n, None), nn.Module) for n in names):
            continue
        fused = fuse_packed([getattr(module, n) for n in names])
        if fused is not None:
            module.__dict__["fused"] = fused  # a plain attribute: not a submodule, no second copy in state_dict
            made += 1
    return made


def fused_projections(module: nn.Module, x: torch.Tensor, names: tuple[str, ...]) -> tuple[torch.Tensor, ...]:
    """(module.<name>(x) for name in names): through the module's FusedPacked (fuse_projections) when it has one."""
    fused = module.__dict__.get("fused")
    if fused is not None:
        return fused(x)
    return tuple(getattr(module, n)(x) for n in names)


ARENA_ALIGN = 64
"""Byte alignment of each buffer in a pack_arena allocation (a cache line)."""


def arena_copies(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of CPU tensors (any shapes and dtypes) in one numpy allocation, each starting on an ARENA_ALIGN boundary.

    The allocation is cache.paged.host_empty's (numpy's allocator, which on Linux asks for transparent huge pages for
    4 MiB or more, where torch's does not): a packed weight read once per token from 2 MiB pages instead of 4 KiB ones misses
    the TLB 512 times less often. Gemma 3's 189 MB q8_0 output projection took 8.4 ms a token on one thread from
    numpy's memory against 13.0 from torch's (alternated, under load; a plain read of its bytes: 7.8).

    >>> a, b = torch.arange(6, dtype=torch.int16).view(2, 3), torch.ones(5, dtype=torch.uint8)
    >>> x, y = arena_copies([a, b])
    >>> torch.equal(x, a), torch.equal(y, b), y.data_ptr() % ARENA_ALIGN
    (True, True, 0)
    """
    sizes = [t.numel() * t.element_size() for t in tensors]
    offsets, total = [], 0
    for size in sizes:
        offsets.append(total)
        total += -(-size // ARENA_ALIGN) * ARENA_ALIGN
    arena = host_empty((total + ARENA_ALIGN,), torch.uint8, "cpu")  # numpy's allocator: huge pages
    first = -arena.data_ptr() % ARENA_ALIGN
    copies = []
    for t, offset, size in zip(tensors, offsets, sizes):
        copy = arena[first + offset : first + offset + size].view(t.dtype).view(t.shape)
        copy.copy_(t)
        copies.append(copy)
    return copies


def pack_arena(model: nn.Module) -> int:
    """Move the buffers of every packed layer of `model` on the CPU into one allocation (arena_copies: huge pages),
    the stacked buffers of its FusedPacked projections (fuse_projections) included, whose parts then view them
    again. The same values: every product is bit for bit what it was. Apply it to the model as it will run,
    after fuse_projections. Returns the bytes moved.

    >>> layer = PackedLinear("q8_0", torch.ones(4, 1, 32, dtype=torch.int8), torch.ones(4, 1), None)
    >>> x = torch.randn(1, 32)
    >>> before = layer(x)
    >>> pack_arena(layer), torch.equal(layer(x), before)
    (144, True)
    """
    fused = [f for module in model.modules() if isinstance(f := module.__dict__.get("fused"), FusedPacked) and f.current()]
    in_fused = {id(p) for f in fused for p in f.parts}
    layers = [f.whole for f in fused] + [m for m in model.modules() if isinstance(m, _Packed) and id(m) not in in_fused]
    held = [(layer, name) for layer in layers if layer.qs.device.type == "cpu"
            for name in ("qs", "d_bits", "m_bits") if layer._buffers.get(name) is not None]
    copies = arena_copies([layer._buffers[name] for layer, name in held])
    for (layer, name), copy in zip(held, copies):
        layer._buffers[name] = copy
        layer.__dict__.pop("_cached_parts", None)
    for f in fused:
        f.bind()
    return sum(c.numel() * c.element_size() for c in copies)


def weight_bytes(model: nn.Module) -> int:
    """Bytes a model's weights take in memory: every parameter and every packed layer's buffers."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    for module in model.modules():
        if isinstance(module, _Packed):
            total += sum(b.numel() * b.element_size() for b in module.buffers(recurse=False))
    return total


def set_activation_format(model: nn.Module, activation_format: str) -> str:
    """Set how every packed layer of `model` multiplies its decode-sized CPU calls (ops.packed_linear.ACTIVATION_FORMATS:
    "auto" resolved for this host; "int8" refused in one line where the host cannot run it). Returns "float32" or "int8".

    >>> import torch
    >>> layer = PackedLinear("q8_0", torch.zeros(2, 1, 32, dtype=torch.int8), torch.ones(2, 1), None)
    >>> set_activation_format(layer, "float32"), layer.activations
    ('float32', 'float32')
    """
    return _set_on_packed(model, "activations", resolve_activation_format(activation_format))


def set_prefill_dtype(model: nn.Module, prefill_dtype: str) -> str:
    """Set what every packed layer of `model` multiplies its prefill-sized CPU calls in (ops.packed_linear.PREFILL_DTYPES;
    "bfloat16" refused in one line where torch's CPU lacks fast bfloat16). Returns prefill_dtype.

    >>> import torch
    >>> layer = PackedLinear("q8_0", torch.zeros(2, 1, 32, dtype=torch.int8), torch.ones(2, 1), None)
    >>> set_prefill_dtype(layer, "float32"), layer.prefill_dtype
    ('float32', 'float32')
    """
    return _set_on_packed(model, "prefill_dtype", resolve_prefill_dtype(prefill_dtype))


def _set_on_packed(model: nn.Module, name: str, value: str) -> str:
    """Set attribute `name` to `value` on every packed layer of `model`; returns value."""
    for module in model.modules():
        if isinstance(module, _Packed):
            setattr(module, name, value)
    return value


def is_packed(model: nn.Module) -> bool:
    """Whether some layer of `model` keeps its weight packed."""
    return any(isinstance(module, _Packed) for module in model.modules())


__all__ = ["WEIGHT_FORMATS", "FusedPacked", "PackedEmbedding", "PackedLinear", "fuse_packed", "fuse_projections",
           "fused_projections", "is_packed", "arena_copies", "pack_arena",
           "set_activation_format", "set_prefill_dtype", "weight_bytes"]
