"""The compiled CPU decode-attention kernel (numba), run over key/value blocks read in place.

    out, lse = attend_blocks(q, k_blocks, v_store, Dv, arrays, threads=T, scale=s, window=W)   # paged blocks
    decoded = decode_attention(q, k, v, scale=s, q_pos=..., kv_pos=..., window=W)               # contiguous K/V, or None
    out, lse = LayerCall(q_shape, Hkv, Dv, dtype, False, arrays, threads=T, scale=s)(q, k_blocks, v_blocks, W)  # per step

Two callers share it. ops.paged_decode runs the engine's paged cache through attend_blocks. And
ops.attention sends its decode-sized CPU calls (at most MAX_QUERIES queries per sequence, float32 /
bfloat16 / float16, no softcap) through decode_attention: a contiguous K/V of one sequence is a
paged cache whose blocks follow each other, so the kernel reads it in place. That path replaces
a GQA matmul over a (B, Hkv, G * Sq, Sk) score tensor with one pass over the keys per KV head and
its G query heads. At 4K-64K keys it takes 0.27-0.67x the matmul path's time (quiet machine; the
figures are in docs/benchmarks.md).

The kernel (treeattn.ops.paged_cpu_kernel) takes the queries in float32, widens 16-bit
elements to float32 in registers and fp8 blocks block by block (fp8 blocks dequantized with their scales), runs an
online softmax in float32, and splits each row's blocks into
ranges that threads attend in parallel before merging them. A key at kv_pos is visible to a query
at q_pos iff kv_pos <= q_pos (and q_pos - kv_pos < W with a window); a query at q_pos -1 sees
nothing. Without numba, decode_attention returns None and its caller keeps its own path.
"""

from __future__ import annotations

import numpy as np
import torch

from treeattn.ops.fp8 import FP8
from treeattn.ops.kernels import optional_kernel

# Block ranges per query row when rows alone would leave threads idle: enough ranges that every
# thread gets SPLITS_PER_THREAD of them, and never fewer than MIN_BLOCKS_PER_SPLIT blocks in a range (one
# thread: one range per row). numba hands a prange's items to its threads in equal static shares, and a
# range is ceil(blocks / ranges) blocks, so one range a thread loads the busiest thread least: a decode row of
# 17 blocks (SmolLM2 at 4K: 4,100 positions) on 2 threads is 9 + 8 blocks, where 2 ranges a thread gave
# 5 + 5 and 5 + 2 (the first thread 10 of 17). At 32 blocks (8K) both are 16 + 16.
SPLITS_PER_THREAD = 1
MIN_BLOCKS_PER_SPLIT = 1
# A call that reads fewer key slots than this (query rows x blocks x block size) runs on one thread. On a quiet
# machine a second thread pays from about 256 positions (benchmarks/kernels/paged_kernel_threads.py, one row of
# SmolLM2's heads, this project's Intel Xeon alone: 512 positions 84-129 us on 1 thread, 68-88 on 2; 1,024: 234-237
# against 139; raw docs/data/quiet_s24/paged_kernel_threads.txt); on a busy one a parallel call waits for a
# descheduled worker (load 2.9-4.1: 64 positions 47-97 us on 1 thread, 0.6-11.5 ms on 2; 1,024: 235-428 us against
# 0.6-12 ms; raw docs/data/kernel_threads/). The threshold gives up up to ~40 us a call on a quiet machine between 256
# and 1,024 positions (a short chat's context, Gemma 3's 512-token windows) for that robustness. One range a row is
# also what one thread computes, so a short context's bits do not depend on the thread count.
PARALLEL_MIN_SLOTS = 1024
# ops.attention calls with at most this many queries per sequence go to the kernel (decode steps
# and their drafts); longer ones (prefill) stay on the matmul path, which batches queries.
MAX_QUERIES = 16
_BITS = {torch.float32: torch.float32, torch.bfloat16: torch.uint16, torch.float16: torch.int16, FP8: torch.uint8}


def kernel_module():
    """treeattn.ops.paged_cpu_kernel, or None when numba is not installed (ops.kernels)."""
    return optional_kernel("paged_cpu_kernel")


def kernel_threads(threads: int, rows: int, blocks_per_row: int, block_size: int) -> int:
    """The threads a call of `rows` query rows over `blocks_per_row` blocks of `block_size` slots runs on: 1 below
    PARALLEL_MIN_SLOTS key slots read, else `threads`.

    >>> kernel_threads(2, 1, 4, 16), kernel_threads(2, 1, 256, 16)
    (1, 2)
    """
    return 1 if rows * blocks_per_row * block_size < PARALLEL_MIN_SLOTS else threads


def kernel_splits(threads: int, rows: int, blocks_per_row: int) -> int:
    """Block ranges per query row (see SPLITS_PER_THREAD)."""
    if threads <= 1:
        return 1
    return max(1, min(max(1, blocks_per_row // MIN_BLOCKS_PER_SPLIT), -(-SPLITS_PER_THREAD * threads // max(rows, 1))))


def attend_blocks(q: torch.Tensor, k_blocks: torch.Tensor, v_store: torch.Tensor, Dv: int, arrays, *, threads: int,
                  scale: float, window: int | None, k_scales: torch.Tensor | None = None,
                  v_scales: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel over blocks read in place.

    Args:
        q: (B, Sq, Hq, D) float tensor on the CPU (taken in float32).
        k_blocks: (NB, BS, Hkv, D) contiguous, float32, bfloat16, float16 or float8_e4m3fn.
        v_store: (NB, BS, Hkv, Dv) contiguous in k_blocks' dtype, or k_blocks itself when the
            values are its first Dv channels.
        k_scales, v_scales: float32 (NB, BS, Hkv) contiguous, the scale of every key and value of
            float8_e4m3fn blocks (treeattn.ops.fp8); None for other dtypes.
        arrays: (table (B, nb), kv_pos (B, nb * BS), row_seq (B * Sq,), q_pos (B * Sq,), splits), the
            first four C-contiguous int64 numpy arrays (row_seq: each query row's sequence).

    Returns:
        out (B, Sq, Hq, Dv) in q.dtype, lse (B, Hq, Sq) float32; a row that sees no key: 0, -inf.
    """
    call = LayerCall(q.shape, k_blocks.shape[2], Dv, k_blocks.dtype, v_store is k_blocks, arrays, threads=threads, scale=scale)
    return call(q, k_blocks, v_store, window, k_scales, v_scales)


class LayerCall:
    """attend_blocks for every layer of one step, with what the layers share made once: the
    kernel's arrays, threads, scale and output shapes. A layer's call (__call__) is numpy views
    around one kernel call, with no torch op before the kernel: the same arithmetic and bits as
    attend_blocks (ops.paged_decode.layer_call builds one after paged_decode_attention's checks).

    Args:
        q_shape: (B, Sq, Hq, D) of every layer's queries; Hkv, Dv: the blocks' KV heads and value dim.
        dtype: the blocks' dtype (float32, bfloat16, float16 or float8_e4m3fn).
        values_in_keys: the values are the keys' first Dv channels (a call's v_blocks is then not read).
        arrays, threads, scale: as attend_blocks takes them.
        views: a dict that keeps the numpy views of the blocks (and scales) a call was given, keyed by the blocks
            tensor, for the next call with the same tensors: a cache passes its own (treeattn.cache.PagedKVCache's
            kernel_views), so the views of its layers are made once, not in every layer of every step. None: none kept.
    """

    def __init__(self, q_shape: tuple[int, int, int, int], Hkv: int, Dv: int, dtype: torch.dtype, values_in_keys: bool, arrays,
                 *, threads: int, scale: float, views: dict | None = None) -> None:
        B, Sq, Hq, D = q_shape
        self.values_in_keys = values_in_keys
        self.kernel = kernel_module()
        self.entry = self.kernel.entry(threads, Hkv, Hq // Hkv, D, Dv)  # the kernel's choices for these shapes, made once
        self.views = views
        self.q_shape, self.bits, self.arrays, self.threads, self.scale = tuple(q_shape), _BITS[dtype], arrays, threads, scale
        self.rows = (B * Sq, Hkv, Hq // Hkv, D)
        self.out_shape, self.lse_shape, self.Dv = (B * Sq, Hkv, Hq // Hkv, Dv), (B * Sq, Hkv, Hq // Hkv), Dv
        self.shapes = (B, Sq, Hq, Dv), (B, Sq, Hq)

    def __call__(self, q: torch.Tensor, k_blocks: torch.Tensor, v_blocks: torch.Tensor, window: int | None,
                 k_scales: torch.Tensor | None = None, v_scales: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer: q (B, Sq, Hq, D), the layer's blocks and scales as paged_decode_attention takes them, of
        the shapes, dtypes and layout this call was built for (every layer of a cache's step has them).
        Returns attend_blocks' out (B, Sq, Hq, Dv) in q.dtype and lse (B, Hq, Sq) float32."""
        v_store = k_blocks if self.values_in_keys else v_blocks
        q_rows = q if q.dtype == torch.float32 and q.is_contiguous() else q.to(torch.float32).contiguous()
        out, lse = np.empty(self.out_shape, dtype=np.float32), np.empty(self.lse_shape, dtype=np.float32)
        table, kv_pos, row_seq, q_pos, splits = self.arrays
        self.entry(q_rows.numpy().reshape(self.rows), *self._block_views(k_blocks, v_store, k_scales, v_scales), self.Dv,
                   self.scale, table, kv_pos, row_seq, q_pos, window or 0, splits, out, lse)
        out_shape, lse_shape = self.shapes
        out = torch.from_numpy(out.reshape(out_shape))
        lse = torch.from_numpy(lse.reshape(lse_shape))
        lse = lse.view(lse_shape[0], lse_shape[2], 1) if lse_shape[1] == 1 else lse.transpose(1, 2).contiguous()
        return (out if q.dtype == torch.float32 else out.to(q.dtype)), lse

    def _block_views(self, k_blocks: torch.Tensor, v_store: torch.Tensor, k_scales, v_scales) -> tuple:
        """(keys, values, key scales, value scales) as the kernel reads them: numpy views (the blocks' bits), kept in
        self.views for the next call with the same tensors."""
        views = None if self.views is None else self.views.get(id(k_blocks))
        if (views is None or views[0] is not k_blocks or views[1] is not v_store or views[2] is not k_scales
                or views[3] is not v_scales):
            kernel = self.kernel
            scales = (kernel.NO_SCALES, kernel.NO_SCALES) if k_scales is None else (k_scales.numpy(), v_scales.numpy())
            views = (k_blocks, v_store, k_scales, v_scales, k_blocks.view(self.bits).numpy(), v_store.view(self.bits).numpy(),
                     *scales)
            if self.views is not None:  # the tensors are kept with their views: an id is never reused while it is here
                self.views[id(k_blocks)] = views
        return views[4:]


def decode_block(keys: int) -> int:
    """The block length decode_attention reads a contiguous K/V of `keys` keys in: the largest of 256, 128, 64, 32, 16
    that divides it (several blocks per row: threads share a row), else all of them in one.

    >>> decode_block(4096), decode_block(527), decode_block(272)
    (256, 527, 16)
    """
    return next((b for b in (256, 128, 64, 32, 16) if keys % b == 0), keys)


def contiguous_layout(B: int, Sq: int, keys: int) -> tuple[int, int, np.ndarray, int, int]:
    """How decode_attention reads B contiguous K/V of `keys` keys each for Sq queries a sequence: (block length,
    blocks a sequence, the block table (B, nb) int64, the kernel's threads, its splits), the threads chosen by
    kernel_threads from torch's count. The compiled decode's window layers call the kernel with the same.

    >>> block, nb, table, threads, splits = contiguous_layout(2, 1, 512)
    >>> block, nb, table.tolist()
    (256, 2, [[0, 1], [2, 3]])
    """
    block = decode_block(keys)
    nb = keys // block
    threads = kernel_threads(torch.get_num_threads(), B * Sq, nb, block)
    return block, nb, np.arange(B * nb, dtype=np.int64).reshape(B, nb), threads, kernel_splits(threads, B * Sq, nb)


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float, q_pos: torch.Tensor | None,
                     kv_pos: torch.Tensor | None, window: int | None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """ops.attention's decode case on the CPU through the kernel, or None when it does not take it.

    Args (checked by ops.attention already): q (B, Sq, Hq, D), k (B, Sk, Hkv, D), v (B, Sk, Hkv, Dv)
    of one dtype on the CPU; q_pos (1 or B, Sq) and kv_pos (1 or B, Sk) int64 for a causal call, both
    None for one that sees every key; window only with positions.

    Returns (out (B, Sq, Hq, Dv) in q.dtype, lse (B, Hq, Sq) float32), or None: no numba, another
    dtype (float64 stays on the matmul path), more than MAX_QUERIES queries, no keys, a query
    position below 0 (the kernel reads -1 as "sees nothing"; ops.attention does not), or inputs
    that autograd records (the kernel has no backward).
    """
    B, Sq, Hq, D = q.shape
    Sk = k.shape[1]
    if (
        q.device.type != "cpu"
        or q.dtype not in _BITS
        or q.dtype == FP8
        or k.dtype != q.dtype
        or v.dtype != q.dtype
        or not 1 <= Sq <= MAX_QUERIES
        or B == 0
        or Sk == 0
        or kernel_module() is None
    ):
        return None
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return None  # the kernel has no backward: a call that autograd records keeps the differentiable path
    if q_pos is None:  # every key visible: every position 0
        q_pos = torch.zeros(B, Sq, dtype=torch.int64)
        kv_pos = torch.zeros(B, Sk, dtype=torch.int64)
    elif bool((q_pos < 0).any()):
        return None
    block, nb, table, threads, splits = contiguous_layout(B, Sq, Sk)
    k_blocks = k.contiguous().view(B * nb, block, *k.shape[2:])
    v_blocks = v.contiguous().view(B * nb, block, *v.shape[2:])
    # the block table and each row's sequence in numpy (a decode step's window layers come here in every layer)
    arrays = (table, kv_pos.expand(B, Sk).contiguous().numpy(), np.repeat(np.arange(B, dtype=np.int64), Sq),
              q_pos.expand(B, Sq).reshape(-1).contiguous().numpy(), splits)
    return attend_blocks(q, k_blocks, v_blocks, v.shape[-1], arrays, threads=threads, scale=scale, window=window)
