"""Decode attention over a paged KV cache, reading the blocks in place (no gathered copy).

    layout = PagedDecodeLayout(block_table, kv_pos, q_pos, block_size=BS)     # once per step
    out, lse = paged_decode_attention(q, k_blocks, v_blocks, layout, window=W)   # once per layer
    out, lse = paged_decode_attention(q, k_codes, v_codes, layout, k_scales=ks, v_scales=vs)   # an fp8 cache
    call = layer_call(q, k_blocks, v_blocks, layout)   # once per step: the CPU kernel's call, or None
    out, lse = call(q, k_blocks, v_blocks, W)           # each layer, as paged_decode_attention, checked once

    block_table: int64 (B, nb)       the blocks of each sequence (any order, padding blocks too)
    kv_pos:      int64 (B, nb * BS)  the position of every slot of those blocks; a slot that holds no
                                     key (past a sequence's end, a padding block) has a position no
                                     query reaches (treeattn.cache.sharded.INVISIBLE_POSITION)
    q_pos:       int64 (B, Sq)       the queries' positions (-1: a padding query, sees nothing)
    q:           (B, Sq, Hq, D)      the step's queries; Hq % Hkv == 0
    k_blocks:    (NB, BS, Hkv, D)    every block of the layer (PagedKVCache.blocks(layer)), in the
                                     cache's dtype, which may differ from q's (float32, bfloat16,
                                     float16, float8_e4m3fn: a --kv-cache-dtype); read as stored,
                                     in float32
    v_blocks:    (NB, BS, Hkv, Dv)   (a view of k_blocks[..., :Dv] for MLA's latent cache)
    k_scales:    (NB, BS, Hkv)       float32, float8_e4m3fn blocks only: key (slot, head)'s value is
    v_scales:    (NB, BS, Hkv)       its code times its scale (PagedKVCache.block_scales, ops.fp8)
    out:         (B, Sq, Hq, Dv) in q.dtype;  lse: (B, Hq, Sq) float32 (natural log, scale included)

A key at kv_pos is visible to a query at q_pos iff kv_pos <= q_pos (and q_pos - kv_pos < window
with the layer's sliding window W). The result is one rank's attention state: tree decoding merges the ranks'
states with combine_states, exactly as for ops.attention.

Everything that depends only on the step (shapes, dtypes and ranges of the table and positions)
is checked once, when the layout is built; a layer's call checks only that q and the blocks fit
it (a few integer comparisons, no read of tensor data).

Where it runs: CPU blocks of float32, bfloat16, float16 or fp8 go to a compiled kernel
(treeattn.ops.cpu_decode over treeattn.ops.paged_cpu_kernel, numba: one pass over each row's blocks in place, 16-bit
elements widened to float32 in registers, fp8 blocks dequantized block by block (each code times its
scale, exactly), the G query heads of a KV head together, queries taken in
float32, online softmax in float32, block ranges in parallel then merged). CUDA tensors go to the
Triton paged decode kernel (treeattn.ops.triton_decode.paged_decode_attention, the static decode
step's) when it takes them (q and blocks of one dtype, or fp8 blocks with their scales; Sq <= 16,
power-of-two head dims, float16/bfloat16/float32 queries). Every other input (other dtypes and devices, no numba or triton)
gathers the blocks into one (B, nb * BS, Hkv, D) copy in q's dtype (float32 at least) and calls
ops.attention, which is exact too but reads K/V twice (the copy, then the attention).
"""

from __future__ import annotations


import torch

from treeattn.ops.attention import attention
from treeattn.ops.cpu_decode import LayerCall, kernel_module, kernel_splits, kernel_threads
from treeattn.ops.fp8 import FP8, dequantize_fp8
from treeattn.ops.validation import check_scale, check_window

KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16, FP8)
"""Cache dtypes the in-place kernels read (the CPU kernel widens the 16-bit and fp8 ones to float32)."""
QUERY_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
"""Query dtypes the in-place kernels take (fp8 blocks are read with queries of any of these)."""


def kernel_takes(dtype: torch.dtype, device: torch.device | str, q_dtype: torch.dtype | None = None) -> bool:
    """Whether a kernel that reads the blocks in place runs a cache of this dtype and device, with
    queries of q_dtype (None: the cache's; float32 for fp8): float32, bfloat16, float16 or fp8 blocks
    and float32, bfloat16 or float16 queries on the CPU with numba installed; on CUDA with triton
    installed, float16/bfloat16/float32 blocks of the queries' dtype or fp8 blocks (the Triton kernel
    may still decline a call's head dims or query count: that call gathers). Otherwise
    paged_decode_attention gathers the blocks."""
    device = torch.device(device)
    q_dtype = (torch.float32 if dtype == FP8 else dtype) if q_dtype is None else q_dtype
    if device.type == "cuda":
        return (
            dtype in KERNEL_DTYPES
            and (q_dtype == dtype or (dtype == FP8 and q_dtype in QUERY_DTYPES))
            and _triton_module() is not None
        )
    return dtype in KERNEL_DTYPES and q_dtype in QUERY_DTYPES and device.type == "cpu" and kernel_module() is not None


def _triton_module():
    """treeattn.ops.triton_decode, or None without triton."""
    from treeattn.ops.attention import _triton_decode_module

    return _triton_decode_module()


def _triton_kernel(q: torch.Tensor):
    """The Triton decode module for q's device (CUDA), or None: q elsewhere, or no triton."""
    return _triton_module() if q.device.type == "cuda" else None


class PagedDecodeLayout:
    """The step's part of paged decode attention: which blocks and positions each sequence's
    queries see. Built and checked once per step, used by every layer.

    Args:
        block_table: int64 (B, nb) block ids (nb may be 0: nothing to attend to on this rank).
        kv_pos: int64 (B, nb * block_size) position of every slot of the table's blocks.
        q_pos: int64 (B, Sq) positions of the queries (Sq >= 1; -1 for padding queries).
        block_size: tokens per block (BS >= 1).
        threads: threads for the kernel (default: torch.get_num_threads(), or 1 for a step that reads fewer than
            cpu_decode.PARALLEL_MIN_SLOTS key slots: cpu_decode.kernel_threads).

    Raises:
        TypeError / ValueError naming the argument, on tensors of the wrong dtype, shape or device.
    """

    def __init__(self, block_table: torch.Tensor, kv_pos: torch.Tensor, q_pos: torch.Tensor, *, block_size: int,
                 threads: int | None = None) -> None:
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be an int >= 1, got {block_size!r}")
        for name, t in (("block_table", block_table), ("kv_pos", kv_pos), ("q_pos", q_pos)):
            if not isinstance(t, torch.Tensor) or t.dtype != torch.int64 or t.dim() != 2:
                got = f"{t.dtype} tensor of shape {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
                raise TypeError(f"{name} must be a 2-D int64 tensor, got {got}")
        B, nb = block_table.shape
        if tuple(kv_pos.shape) != (B, nb * block_size):
            raise ValueError(f"kv_pos must have shape (B, nb * block_size) = {(B, nb * block_size)}, got {tuple(kv_pos.shape)}")
        if q_pos.shape[0] != B or q_pos.shape[1] < 1:
            raise ValueError(f"q_pos must have shape (B={B}, Sq >= 1), got {tuple(q_pos.shape)}")
        if not (block_table.device == kv_pos.device == q_pos.device):
            raise ValueError(f"block_table, kv_pos and q_pos must be on one device, got {block_table.device}, "
                             f"{kv_pos.device}, {q_pos.device}")
        if block_table.numel() and int(block_table.min()) < 0:
            raise ValueError(f"block_table must hold block ids >= 0, got {int(block_table.min())}")
        self.block_table, self.kv_pos, self.q_pos = block_table, kv_pos, q_pos
        self.batch, self.queries, self.block_size = B, q_pos.shape[1], block_size
        self.max_block = int(block_table.max()) if block_table.numel() else -1
        if threads is None:
            threads = kernel_threads(torch.get_num_threads(), B * q_pos.shape[1], nb, block_size)
        self.threads = threads
        self._arrays = None  # the kernel's numpy views, made on the first kernel call
        self._triton = None  # the Triton kernel's int32 table and seq_lens, made on its first call

    def _triton_arrays(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(int32 block table, int64 seq_lens) as the Triton paged kernel takes them: every slot of
        the table is a logical key (its position masks it), so seq_lens is nb * block_size."""
        if self._triton is None:
            B, nb = self.block_table.shape
            self._triton = (self.block_table.to(torch.int32),
                            torch.full((B,), nb * self.block_size, dtype=torch.int64, device=self.block_table.device))
        return self._triton

    def _kernel_arrays(self):
        """(table, kv_pos, row_seq, q_pos, splits) as the kernel takes them: C-contiguous numpy int64
        views; one query row per (sequence, query), rows of a sequence together."""
        if self._arrays is None:
            B, Sq = self.batch, self.queries
            rows = B * Sq
            nb = self.block_table.shape[1]
            splits = kernel_splits(self.threads, rows, nb)
            self._arrays = (self.block_table.contiguous().numpy(), self.kv_pos.contiguous().numpy(),
                            torch.arange(B).repeat_interleave(Sq).numpy(), self.q_pos.reshape(-1).contiguous().numpy(), splits)
        return self._arrays


def paged_decode_attention(q: torch.Tensor, k_blocks: torch.Tensor, v_blocks: torch.Tensor, layout: PagedDecodeLayout, *,
                           scale: float | None = None, window: int | None = None, k_scales: torch.Tensor | None = None,
                           v_scales: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's attention of q over the blocks of `layout`, read in place.

    Args:
        q: (B, Sq, Hq, D) float tensor, B and Sq those of the layout.
        k_blocks: (NB, BS, Hkv, D), the layer's blocks on q's device, in q's dtype or the cache's
            (float32, bfloat16, float16, float8_e4m3fn); NB > every id in the table.
        v_blocks: (NB, BS, Hkv, Dv), or a view of k_blocks[..., :Dv] (its first Dv channels).
        layout: the step's PagedDecodeLayout.
        scale: softmax scale, default D ** -0.5.
        window: this layer's sliding window W (a key is visible iff 0 <= q_pos - kv_pos < W) or None.
        k_scales, v_scales: float32 (NB, BS, Hkv) on q's device, given exactly with float8_e4m3fn
            blocks: the blocks hold codes, key (b, t, h) is k_blocks[b, t, h] * k_scales[b, t, h]
            (treeattn.ops.fp8), likewise the values.

    Returns:
        out (B, Sq, Hq, Dv) in q.dtype and lse (B, Hq, Sq) float32 (float64 for float64 q): this
        rank's attention state; a query that sees no key has out = 0, lse = -inf.
    """
    scale, window = _check_call(q, k_blocks, v_blocks, layout, scale, window, k_scales, v_scales)
    triton = _triton_kernel(q)
    if (triton is not None and k_blocks.dtype in (q.dtype, FP8)
            and triton.unsupported_reason(q, k_blocks, v_blocks) is None):
        table, seq_lens = layout._triton_arrays()
        return triton.paged_decode_attention(q, k_blocks, v_blocks, table, seq_lens, scale=scale, causal=True, q_pos=layout.q_pos,
                                             kv_pos=layout.kv_pos, window=window, k_scales=k_scales, v_scales=v_scales)
    call = _cpu_call(q, k_blocks, v_blocks, layout, scale, k_scales, v_scales)
    if call is not None:
        return call(q, k_blocks, v_blocks, window, k_scales, v_scales)
    return _gathered_attention(q, k_blocks, v_blocks, layout, scale, window, k_scales, v_scales)


def layer_call(q: torch.Tensor, k_blocks: torch.Tensor, v_blocks: torch.Tensor, layout: PagedDecodeLayout, *,
               scale: float | None = None, k_scales: torch.Tensor | None = None,
               v_scales: torch.Tensor | None = None, views: dict | None = None) -> LayerCall | None:
    """paged_decode_attention's CPU kernel for every layer of a step, checked once: a
    treeattn.ops.cpu_decode.LayerCall, or None where paged_decode_attention would not run the CPU kernel
    (CUDA, a dtype or layout it does not take, no numba). Arguments as paged_decode_attention's, of one
    layer; call(q, k_blocks, v_blocks, window, k_scales, v_scales) then runs any layer whose tensors
    have the same shapes, dtypes and strides (a PagedKVCache's layers: views of one arena), bit for bit
    as paged_decode_attention. views: where the call keeps the blocks' numpy views between calls (LayerCall's;
    PagedKVCache.kernel_views). Raises as paged_decode_attention on bad input.

    >>> import torch
    >>> from treeattn.ops.paged_decode import PagedDecodeLayout, layer_call, paged_decode_attention
    >>> layout = PagedDecodeLayout(torch.tensor([[0]]), torch.arange(4)[None], torch.tensor([[3]]), block_size=4)
    >>> q, k, v = torch.randn(1, 1, 2, 8), torch.randn(1, 4, 1, 8), torch.randn(1, 4, 1, 8)
    >>> call = layer_call(q, k, v, layout)
    >>> call is None or all(torch.equal(a, b) for a, b in zip(call(q, k, v, None), paged_decode_attention(q, k, v, layout)))
    True
    """
    scale, _ = _check_call(q, k_blocks, v_blocks, layout, scale, None, k_scales, v_scales)
    if _triton_kernel(q) is not None:
        return None
    return _cpu_call(q, k_blocks, v_blocks, layout, scale, k_scales, v_scales, views)


def _cpu_call(q, k_blocks, v_blocks, layout: PagedDecodeLayout, scale: float, k_scales, v_scales,
              views: dict | None = None) -> LayerCall | None:
    """The CPU kernel's LayerCall for these (checked) tensors, or None where it does not take them."""
    values_in_keys = v_blocks.data_ptr() == k_blocks.data_ptr() and v_blocks.stride() == k_blocks.stride()
    if not (kernel_takes(k_blocks.dtype, q.device, q.dtype) and k_blocks.is_contiguous()
            and (values_in_keys or v_blocks.is_contiguous())
            and (k_scales is None or (k_scales.is_contiguous() and v_scales.is_contiguous()))):
        return None
    return LayerCall(tuple(q.shape), k_blocks.shape[2], v_blocks.shape[-1], k_blocks.dtype, values_in_keys,
                     layout._kernel_arrays(), threads=layout.threads, scale=scale, views=views)


def _check_call(q, k_blocks, v_blocks, layout: PagedDecodeLayout, scale, window, k_scales, v_scales) -> tuple[float, int | None]:
    """paged_decode_attention's checks of one call (see there); returns the checked scale and window."""
    B, Sq, Hq, D = q.shape if q.dim() == 4 else (None,) * 4
    if q.dim() != 4 or (B, Sq) != (layout.batch, layout.queries):
        raise ValueError(f"q must have shape (B={layout.batch}, Sq={layout.queries}, Hq, D) to match the layout, got "
                         f"{tuple(q.shape)}")
    if (
        k_blocks.dim() != 4
        or v_blocks.dim() != 4
        or k_blocks.shape[:3] != v_blocks.shape[:3]
        or k_blocks.shape[1] != layout.block_size
    ):
        raise ValueError(f"k_blocks and v_blocks must have shapes (NB, BS={layout.block_size}, Hkv, D) and (NB, BS, Hkv, Dv), "
                         f"got {tuple(k_blocks.shape)} and {tuple(v_blocks.shape)}")
    NB, BS, Hkv, Dk = k_blocks.shape
    if Dk != D or Hq % Hkv or layout.max_block >= NB:
        raise ValueError(f"q (B, Sq, Hq={Hq}, D={D}) and k_blocks (NB={NB}, BS, Hkv={Hkv}, D={Dk}) must share D, with Hq a "
                         f"multiple of Hkv, and the table's ids (up to {layout.max_block}) must be < NB")
    if (k_blocks.dtype != v_blocks.dtype or not k_blocks.dtype.is_floating_point or not q.dtype.is_floating_point
            or k_blocks.device != q.device or v_blocks.device != q.device):
        raise TypeError(f"q, k_blocks, v_blocks must be floating tensors on one device, the blocks of one dtype, got "
                        f"{q.dtype}/{q.device}, {k_blocks.dtype}/{k_blocks.device}, {v_blocks.dtype}/{v_blocks.device}")
    _check_scales(k_blocks, k_scales, v_scales, q.device)
    return check_scale(scale, D), check_window(window)


def _check_scales(k_blocks: torch.Tensor, k_scales, v_scales, device: torch.device) -> None:
    """Scales come with fp8 blocks and only with them: float32 (NB, BS, Hkv) each, on q's device."""
    fp8 = k_blocks.dtype == FP8
    if not fp8 and k_scales is None and v_scales is None:
        return
    if not fp8:
        raise TypeError(f"k_scales and v_scales go with float8_e4m3fn blocks only, got {k_blocks.dtype} blocks with scales")
    for name, t in (("k_scales", k_scales), ("v_scales", v_scales)):
        if (not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or tuple(t.shape) != tuple(k_blocks.shape[:3])
                or t.device != device):
            got = f"{t.dtype} tensor of shape {tuple(t.shape)} on {t.device}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise TypeError(f"{name} must be a float32 tensor of shape (NB, BS, Hkv) = {tuple(k_blocks.shape[:3])} on {device} "
                            f"with float8_e4m3fn blocks, got {got}")


def _gathered_attention(q, k_blocks, v_blocks, layout: PagedDecodeLayout, scale: float, window: int | None, k_scales=None,
                        v_scales=None):
    """Any dtype and device: the table's blocks gathered into one copy (fp8: dequantized), then
    ops.attention, in q's dtype when the blocks have it, else in the wider of the two and float32
    (out back in q.dtype)."""
    B, nb = layout.block_table.shape
    BS = layout.block_size
    table = layout.block_table.to(k_blocks.device)
    k, v = k_blocks[table], v_blocks[table]  # (B, nb, BS, Hkv, D or Dv)
    if k_scales is not None:  # fp8 codes and their scales: the values they stand for, in float32
        k, v = dequantize_fp8(k, k_scales[table]), dequantize_fp8(v, v_scales[table])
    k = k.reshape(B, nb * BS, *k_blocks.shape[2:])
    v = v.reshape(B, nb * BS, *v_blocks.shape[2:])
    dtype = q.dtype if k.dtype == q.dtype else torch.promote_types(torch.promote_types(q.dtype, k.dtype), torch.float32)
    out, lse = attention(q.to(dtype), k.to(dtype), v.to(dtype), scale=scale, causal=True, q_pos=layout.q_pos.to(q.device),
                         kv_pos=layout.kv_pos.to(q.device), window=window)
    return out.to(q.dtype), lse
