"""Layers whose weights stay in a GGUF file's block formats (q4_0, q4_1, q8_0): the loader's weight_format="packed".

    layer = PackedLinear("q4_1", qs, d, m, bias=None)     # replaces an nn.Linear: y = layer(x)
    embed = PackedEmbedding("q8_0", qs, d, None)           # replaces an nn.Embedding: rows = embed(tokens)
    logits = embed.project(hidden)                         # a tied output projection, packed too
    n = weight_bytes(model)                                 # bytes of every parameter and packed buffer

The quantized values and the float32 scales (unpack_blocks of treeattn.ops.packed_linear) are
buffers: integer tensors, so `model.to(dtype)` leaves them alone. The scales are kept as their int32
bit patterns (viewed as float32 when used) for the same reason: a float buffer would be rounded by
`model.to(torch.bfloat16)`, and the weights would no longer be the file's.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from treeattn.ops.packed_linear import BLOCK, FORMATS, dequantize_packed, kernel_arrays, packed_matmul

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
            raise ValueError(f"m (the blocks' offsets) is given exactly for q4_1, got fmt={fmt!r} and m={'a tensor' if m is not None else None}")
        self.fmt = fmt
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

    def project(self, x: torch.Tensor, rows: slice | None = None) -> torch.Tensor:
        """x (..., columns) @ W.T -> (..., rows) in x.dtype, float32 accumulation; with `rows` (a slice,
        step 1) only those rows of W: the same values as the full product's columns."""
        v = self._cached()
        if rows is None:
            return packed_matmul(x, v.fmt, v.qs, v.d, v.m, arrays=v.arrays)
        arrays = None if v.arrays is None else tuple(a[rows] for a in v.arrays)
        return packed_matmul(x, v.fmt, v.qs[rows], v.d[rows], None if v.m is None else v.m[rows], arrays=arrays)

    def extra_repr(self) -> str:
        return f"{self.fmt}, rows={self.rows}, columns={self.columns}"


class PackedLinear(_Packed):
    """nn.Linear(columns, rows) over a packed weight: forward(x (..., columns)) -> (..., rows) in x.dtype."""

    def __init__(self, fmt: str, qs: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None, bias: torch.Tensor | None = None) -> None:
        super().__init__(fmt, qs, d, m)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        v = self._cached()
        return packed_matmul(x, v.fmt, v.qs, v.d, v.m, self.bias, arrays=v.arrays)


class PackedEmbedding(_Packed):
    """nn.Embedding(rows, columns) over a packed table: forward(tokens int64 (...)) -> float32 (..., columns),
    only the looked-up rows dequantized."""

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        fmt, qs, d, m = self._parts()
        return dequantize_packed(fmt, qs[tokens], d[tokens], None if m is None else m[tokens])


def weight_bytes(model: nn.Module) -> int:
    """Bytes a model's weights take in memory: every parameter and every packed layer's buffers."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    for module in model.modules():
        if isinstance(module, _Packed):
            total += sum(b.numel() * b.element_size() for b in module.buffers(recurse=False))
    return total


def is_packed(model: nn.Module) -> bool:
    """Whether some layer of `model` keeps its weight packed."""
    return any(isinstance(module, _Packed) for module in model.modules())


__all__ = ["WEIGHT_FORMATS", "PackedEmbedding", "PackedLinear", "is_packed", "weight_bytes"]
