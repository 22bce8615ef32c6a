"""One rank's blocks of the engine's sequence-sharded KV cache (the tensors; bookkeeping is in
treeattn.cache.blocks, run by the driver).

    arena: (num_layers, 2, num_blocks + 1, block_size, Hkv, D)   # [layer, k|v, block, slot, head, dim]
           (num_layers, 1, num_blocks + 1, block_size, Hkv, D)   # value_dim given: keys only, V = K[..., :value_dim]

Block `num_blocks` (the last) is never lent: it is zero and pads block tables of different
lengths, with its keys marked invisible by position. A key that is masked out (a slot past a
sequence's end, a padding block) must still be a finite number: masked attention multiplies it by
0, and 0 * NaN is not 0. The arena is allocated with torch.empty (on Linux, pages of blocks never
written are not resident until first written: the engine's ranks write every block once at start,
engine.worker.warmup.pretouch_cache, so that a rank's memory is taken then), and the engine zeroes a
block when a sequence starts filling it (zero_blocks), so the unwritten tail of a block is zeros.

A sequence's blocks on this rank are generally not adjacent, so attention reads them with
gather(): one indexed copy per layer of the blocks a step needs, as a (B, blocks * block_size,
Hkv, D) batch that tree_decode / ring_decode take as this rank's shard.

The stored dtype (`dtype`, the engine's kv_cache_dtype) may be narrower than the model's
(`compute_dtype`): write() rounds the new keys and values into it, and the torch readers, gather()
and run(), hand the stored values back in the compute dtype (exactly: a bfloat16/float16 value is
a float32 one), so attention computes in the model's dtype, accumulating in float32, over what the
cache holds. blocks() gives the stored blocks themselves, for the paged kernel, which widens them
as it reads (treeattn.ops.paged_decode).

An fp8 cache (dtype torch.float8_e4m3fn, kv_cache_dtype "fp8_e4m3") stores e4m3 codes in the
arena and one float32 scale per token and KV head beside it (treeattn.ops.fp8: a power of two set
from that token's row when it is written, never changed after):

    scales: (num_layers, 2 or 1, num_blocks + 1, block_size, Hkv)  float32   # [layer, k|v, block, slot, head]

gather() and run() dequantize (codes * scale, exact in float32); blocks() gives the codes and
block_scales() the scales, for the kernels, which fold the scale into each key's score and each
value's weight. zero_blocks() zeroes the scales too, so an unwritten slot dequantizes to 0.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from treeattn.ops.fp8 import FP8, dequantize_fp8, quantize_fp8


def host_empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """torch.empty(shape, dtype, device), on the CPU from numpy's allocator: on Linux numpy asks for transparent
    huge pages (madvise MADV_HUGEPAGE) for 4 MiB or more, torch's allocator does not, and the paged kernel reads a
    layer's blocks with fewer TLB misses from 2 MiB pages (one float16 layer of 30K keys: 3.41 against 3.68 ms on
    one thread, alternated, under load). Pages stay unresident until written, as torch.empty's.

    >>> host_empty((2, 3), torch.float16, "cpu").shape
    torch.Size([2, 3])
    """
    if torch.device(device).type != "cpu":
        return torch.empty(shape, dtype=dtype, device=device)
    count = math.prod(shape)
    return torch.from_numpy(np.empty(count * dtype.itemsize, dtype=np.uint8)).view(dtype).view(shape)


class PagedKVCache:
    """This rank's pool of KV blocks, for every layer.

    Args:
        num_layers, num_kv_heads, head_dim: of the model.
        value_dim: None (values stored beside the keys), or Dv <= head_dim: the values are the first
            Dv channels of the keys, with no storage of their own (MLA's latent cache; see ShardedKVCache).
        num_blocks: blocks this rank lends (the driver's BlockPool of this rank has as many).
        block_size: tokens per block.
        dtype, device: of the stored keys and values (float8_e4m3fn: e4m3 codes with a scale per
            token and KV head, treeattn.ops.fp8).
        compute_dtype: the dtype gather() and run() return (the model's; None: dtype, float32 for fp8).
    """

    def __init__(self, *, num_layers: int, num_kv_heads: int, head_dim: int, num_blocks: int, block_size: int,
                 value_dim: int | None = None, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 compute_dtype: torch.dtype | None = None) -> None:
        for name, value in (("num_layers", num_layers), ("num_kv_heads", num_kv_heads), ("head_dim", head_dim),
                            ("block_size", block_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 0:
            raise ValueError(f"num_blocks must be an int >= 0, got {num_blocks!r}")
        if value_dim is not None and (isinstance(value_dim, bool) or not isinstance(value_dim,
                                                                                    int) or not 1 <= value_dim <= head_dim):
            raise ValueError(f"value_dim must be None or an int in [1, head_dim={head_dim}], got {value_dim!r}")
        self.num_layers, self.num_kv_heads, self.head_dim, self.value_dim = num_layers, num_kv_heads, head_dim, value_dim
        compute_dtype = compute_dtype or (torch.float32 if dtype == FP8 else dtype)
        for name, value in (("dtype", dtype), ("compute_dtype", compute_dtype)):
            if not isinstance(value, torch.dtype) or not value.is_floating_point or (value.itemsize == 1 and value != FP8):
                raise TypeError(f"{name} must be a floating torch.dtype (of 8 bits: float8_e4m3fn), got {value!r}")
        if compute_dtype == FP8:
            raise TypeError(
                f"compute_dtype must be a dtype attention computes in (float32, bfloat16, ...), got {compute_dtype!r}"
            )
        self.num_blocks, self.block_size = num_blocks, block_size
        self.compute_dtype = compute_dtype
        self.pad_block = num_blocks
        self.arena = host_empty((num_layers, 1 if value_dim else 2, num_blocks + 1, block_size, num_kv_heads, head_dim),
                                dtype, device)
        self.arena[:, :, self.pad_block].zero_()
        self.scales = None  # float32 (num_layers, 2 or 1, num_blocks + 1, block_size, Hkv) for an fp8 arena
        if dtype == FP8:
            self.scales = host_empty(self.arena.shape[:-1], torch.float32, device)
            self.scales[:, :, self.pad_block].zero_()
        self._layer_views = [None] * num_layers  # per layer: (blocks(), block_scales(), write()'s planes), made on first use
        self.kernel_views = {}  # the paged CPU kernel's numpy views of the layers' blocks (ops.cpu_decode.LayerCall's views)

    @property
    def dtype(self) -> torch.dtype:
        return self.arena.dtype

    @property
    def device(self) -> torch.device:
        return self.arena.device

    def zero_blocks(self, blocks: torch.Tensor) -> None:
        """Zero the keys and values of `blocks`, int64 (n,) block ids, in every layer."""
        arena = self.arena.view(torch.uint8) if self.scales is not None else self.arena  # torch fills no float8 tensor
        arena.index_fill_(2, blocks, 0)
        if self.scales is not None:
            self.scales.index_fill_(2, blocks, 0)

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store keys and values of n tokens.

        Args:
            layer: layer index.
            slots: int64 (n,) flat slot of each token: block * block_size + offset in the block.
            k, v: (n, Hkv, D), (n, Hkv, Dv) of any float dtype, rounded to the cache's (v not stored with value_dim).
        """
        kv = self._views(layer)[2]
        if self.scales is not None:  # fp8: codes and their scales
            scales = self.scales[layer].view(self.arena.shape[1], -1, self.num_kv_heads)
            for plane, x in enumerate((k,) if self.value_dim else (k, v)):
                codes, x_scales = quantize_fp8(x)
                kv[plane].view(torch.uint8).index_copy_(0, slots, codes.view(torch.uint8))  # as bytes: see zero_blocks
                scales[plane].index_copy_(0, slots, x_scales)
            return
        kv[0].index_copy_(0, slots, k.to(self.dtype))
        if not self.value_dim:
            kv[1].index_copy_(0, slots, v.to(self.dtype))

    def stored(self, x: torch.Tensor) -> torch.Tensor:
        """What this cache holds of keys or values x (..., Hkv, D) once written, back in x's dtype:
        x rounded to the stored dtype (fp8: quantized and dequantized). Ring prefill attends to its
        step's own keys through this, as every read of the cache does."""
        if self.scales is not None:
            return dequantize_fp8(*quantize_fp8(x), x.dtype)
        return x.to(self.dtype).to(x.dtype)

    def gather(self, layer: int, table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of the blocks in `table`, int64 (B, nb) block ids (pad_block where a row
        has fewer): k (B, nb * block_size, Hkv, D), v (B, nb * block_size, Hkv, Dv), copies in the
        compute dtype (v a view of k with value_dim)."""
        B, nb = table.shape
        kv = self._widen(self.arena[layer][:, table], None if self.scales is None else self.scales[layer][:, table])
        return self._split(kv.view(self.arena.shape[1], B, nb * self.block_size, self.num_kv_heads, self.head_dim))

    def run(self, layer: int, first: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of the `count` adjacent blocks from block `first` of `layer`: k (count *
        block_size, Hkv, D), v (..., Dv) in the compute dtype: views of the arena when it stores that
        dtype, else converted copies."""
        blocks = slice(first, first + count)
        kv = self._widen(self.arena[layer, :, blocks], None if self.scales is None else self.scales[layer, :, blocks])
        return self._split(kv.reshape(kv.shape[0], count * self.block_size, self.num_kv_heads, self.head_dim))

    def blocks(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of every stored block of `layer` (the cache's dtype; fp8: the codes): k (num_blocks + 1,
        block_size, Hkv, D), v (..., Dv)."""
        return self._views(layer)[0]

    def block_scales(self, layer: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """An fp8 cache's scales of every block of `layer`, views float32 (num_blocks + 1, block_size,
        Hkv) for k and v (the same for both with value_dim); (None, None) for any other dtype."""
        return self._views(layer)[1]

    def _views(self, layer: int) -> tuple:
        """(blocks(layer), block_scales(layer), the layer's arena as write() indexes it: (planes, slots, Hkv, D)),
        made on the layer's first use and the same tensors after (a decode step reads them in every layer)."""
        views = self._layer_views[layer]
        if views is None:
            scales = (None, None)
            if self.scales is not None:
                scales = (self.scales[layer, 0], self.scales[layer, 0 if self.value_dim else 1])
            planes = self.arena[layer].view(self.arena.shape[1], -1, self.num_kv_heads, self.head_dim)
            views = self._layer_views[layer] = (self._split(self.arena[layer]), scales, planes)
        return views

    def _widen(self, codes: torch.Tensor, scales: torch.Tensor | None) -> torch.Tensor:
        """Stored values in the compute dtype: a view when the arena stores that dtype, else a copy
        (fp8: dequantized with `scales`, the codes' shape without the last dim)."""
        if scales is not None:
            return dequantize_fp8(codes, scales, self.compute_dtype)
        return codes.to(self.compute_dtype)

    def _split(self, kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return (kv[0], kv[0][..., : self.value_dim]) if self.value_dim else (kv[0], kv[1])

    def nbytes(self) -> int:
        scales = 0 if self.scales is None else self.scales.numel() * self.scales.element_size()
        return self.arena.numel() * self.arena.element_size() + scales

    def __repr__(self) -> str:
        return (f"PagedKVCache({self.num_blocks} blocks x {self.block_size} tokens, layers={self.num_layers}, "
                f"Hkv={self.num_kv_heads}, D={self.head_dim}, dtype={self.dtype}, compute_dtype={self.compute_dtype})")
