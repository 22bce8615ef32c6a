"""Decode attention over a paged KV cache, reading the blocks in place (no gathered copy).

    layout = PagedDecodeLayout(block_table, kv_pos, q_pos, block_size=BS)     # once per step
    out, lse = paged_decode_attention(q, k_blocks, v_blocks, layout, window=W)   # once per layer

    block_table: int64 (B, nb)       the blocks of each sequence (any order, padding blocks too)
    kv_pos:      int64 (B, nb * BS)  the position of every slot of those blocks; a slot that holds no
                                     key (past a sequence's end, a padding block) has a position no
                                     query reaches (treeattn.cache.sharded.INVISIBLE_POSITION)
    q_pos:       int64 (B, Sq)       the queries' positions (-1: a padding query, sees nothing)
    q:           (B, Sq, Hq, D)      the step's queries; Hq % Hkv == 0
    k_blocks:    (NB, BS, Hkv, D)    every block of the layer (PagedKVCache.blocks(layer)), in the
                                     cache's dtype, which may differ from q's (float32, bfloat16,
                                     float16: a --kv-cache-dtype); read as stored, in float32
    v_blocks:    (NB, BS, Hkv, Dv)   (a view of k_blocks[..., :Dv] for MLA's latent cache)
    out:         (B, Sq, Hq, Dv) in q.dtype;  lse: (B, Hq, Sq) float32 (natural log, scale included)

A key at kv_pos is visible to a query at q_pos iff kv_pos <= q_pos (and q_pos - kv_pos < window
with the layer's sliding window W). The result is one rank's attention state: tree decoding merges the ranks'
states with combine_states, exactly as for ops.attention.

Everything that depends only on the step (shapes, dtypes and ranges of the table and positions)
is checked once, when the layout is built; a layer's call checks only that q and the blocks fit
it (a few integer comparisons, no read of tensor data).

Where it runs: CPU blocks of float32, bfloat16 or float16 go to a compiled kernel
(treeattn.ops.cpu_decode over treeattn.ops.paged_cpu_kernel, numba: one pass over each row's blocks in place, 16-bit blocks
widened to float32 block by block, the G query heads of a KV head together, queries taken in
float32, online softmax in float32, block ranges in parallel then merged). CUDA tensors go to the
Triton paged decode kernel (treeattn.ops.triton_decode.paged_decode_attention, the static decode
step's) when it takes them (q and blocks of one dtype, Sq <= 16, power-of-two head dims,
float16/bfloat16/float32). Every other input (other dtypes and devices, no numba or triton)
gathers the blocks into one (B, nb * BS, Hkv, D) copy in q's dtype (float32 at least) and calls
ops.attention, which is exact too but reads K/V twice (the copy, then the attention).
"""

from __future__ import annotations


import torch

from treeattn.ops.attention import attention
from treeattn.ops.cpu_decode import attend_blocks, kernel_module, kernel_splits
from treeattn.ops.validation import check_scale, check_window

KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
"""Cache dtypes the in-place kernels read (the CPU kernel widens the 16-bit ones to float32)."""


def kernel_takes(dtype: torch.dtype, device: torch.device | str, q_dtype: torch.dtype | None = None) -> bool:
    """Whether a kernel that reads the blocks in place runs a cache of this dtype and device, with
    queries of q_dtype (None: the cache's): float32, bfloat16 or float16 blocks and queries other
    than float64 on the CPU with numba installed; on CUDA with triton installed, float16/bfloat16/
    float32 blocks of the queries' dtype (the Triton kernel may still decline a call's head dims or
    query count: that call gathers). Otherwise paged_decode_attention gathers the blocks."""
    device = torch.device(device)
    q_dtype = dtype if q_dtype is None else q_dtype
    if device.type == "cuda":
        return dtype in KERNEL_DTYPES and q_dtype == dtype and _triton_module() is not None
    return dtype in KERNEL_DTYPES and q_dtype in KERNEL_DTYPES and device.type == "cpu" and kernel_module() is not None


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
        threads: threads for the kernel (default: torch.get_num_threads()).

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
        self.threads = torch.get_num_threads() if threads is None else threads
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
                           scale: float | None = None, window: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's attention of q over the blocks of `layout`, read in place.

    Args:
        q: (B, Sq, Hq, D) float tensor, B and Sq those of the layout.
        k_blocks: (NB, BS, Hkv, D), the layer's blocks on q's device, in q's dtype or the cache's
            (float32, bfloat16, float16); NB > every id in the table.
        v_blocks: (NB, BS, Hkv, Dv), or a view of k_blocks[..., :Dv] (its first Dv channels).
        layout: the step's PagedDecodeLayout.
        scale: softmax scale, default D ** -0.5.
        window: this layer's sliding window W (a key is visible iff 0 <= q_pos - kv_pos < W) or None.

    Returns:
        out (B, Sq, Hq, Dv) in q.dtype and lse (B, Hq, Sq) float32 (float64 for float64 q): this
        rank's attention state; a query that sees no key has out = 0, lse = -inf.
    """
    B, Sq, Hq, D = q.shape if q.dim() == 4 else (None,) * 4
    if q.dim() != 4 or (B, Sq) != (layout.batch, layout.queries):
        raise ValueError(f"q must have shape (B={layout.batch}, Sq={layout.queries}, Hq, D) to match the layout, got {tuple(q.shape)}")
    if k_blocks.dim() != 4 or v_blocks.dim() != 4 or k_blocks.shape[:3] != v_blocks.shape[:3] or k_blocks.shape[1] != layout.block_size:
        raise ValueError(f"k_blocks and v_blocks must have shapes (NB, BS={layout.block_size}, Hkv, D) and (NB, BS, Hkv, Dv), "
                         f"got {tuple(k_blocks.shape)} and {tuple(v_blocks.shape)}")
    NB, BS, Hkv, Dk = k_blocks.shape
    Dv = v_blocks.shape[-1]
    if Dk != D or Hq % Hkv or layout.max_block >= NB:
        raise ValueError(f"q (B, Sq, Hq={Hq}, D={D}) and k_blocks (NB={NB}, BS, Hkv={Hkv}, D={Dk}) must share D, with Hq a "
                         f"multiple of Hkv, and the table's ids (up to {layout.max_block}) must be < NB")
    if (k_blocks.dtype != v_blocks.dtype or not k_blocks.dtype.is_floating_point or not q.dtype.is_floating_point
            or k_blocks.device != q.device or v_blocks.device != q.device):
        raise TypeError(f"q, k_blocks, v_blocks must be floating tensors on one device, the blocks of one dtype, got "
                        f"{q.dtype}/{q.device}, {k_blocks.dtype}/{k_blocks.device}, {v_blocks.dtype}/{v_blocks.device}")
    scale = check_scale(scale, D)
    window = check_window(window)
    triton = _triton_kernel(q)
    if triton is not None and k_blocks.dtype == q.dtype and triton.unsupported_reason(q, k_blocks, v_blocks) is None:
        table, seq_lens = layout._triton_arrays()
        return triton.paged_decode_attention(q, k_blocks, v_blocks, table, seq_lens, scale=scale, causal=True, q_pos=layout.q_pos,
                                             kv_pos=layout.kv_pos, window=window)
    values_in_keys = v_blocks.data_ptr() == k_blocks.data_ptr() and v_blocks.stride() == k_blocks.stride()
    if kernel_takes(k_blocks.dtype, q.device, q.dtype) and k_blocks.is_contiguous() and (values_in_keys or v_blocks.is_contiguous()):
        return _kernel_attention(q, k_blocks, v_blocks if not values_in_keys else k_blocks, Dv, layout, scale, window)
    return _gathered_attention(q, k_blocks, v_blocks, layout, scale, window)


def _kernel_attention(q, k_blocks, v_store, Dv, layout: PagedDecodeLayout, scale: float, window: int | None):
    """The compiled CPU kernel (ops.cpu_decode): v_store is v_blocks, or k_blocks when the values
    are its first Dv channels."""
    return attend_blocks(q, k_blocks, v_store, Dv, layout._kernel_arrays(), threads=layout.threads, scale=scale, window=window)


def _gathered_attention(q, k_blocks, v_blocks, layout: PagedDecodeLayout, scale: float, window: int | None):
    """Any dtype and device: the table's blocks gathered into one copy, then ops.attention, in q's
    dtype when the blocks have it, else in the wider of the two and float32 (out back in q.dtype)."""
    B, nb = layout.block_table.shape
    BS = layout.block_size
    table = layout.block_table.to(k_blocks.device)
    k = k_blocks[table].reshape(B, nb * BS, *k_blocks.shape[2:])
    v = v_blocks[table].reshape(B, nb * BS, *v_blocks.shape[2:])
    dtype = q.dtype if k.dtype == q.dtype else torch.promote_types(torch.promote_types(q.dtype, k.dtype), torch.float32)
    out, lse = attention(q.to(dtype), k.to(dtype), v.to(dtype), scale=scale, causal=True, q_pos=layout.q_pos.to(q.device),
                         kv_pos=layout.kv_pos.to(q.device), window=window)
    return out.to(q.dtype), lse
