"""One rank's blocks of the engine's sequence-sharded KV cache (the tensors; bookkeeping is in
treeattn.cache.blocks, run by the driver).

    arena: (num_layers, 2, num_blocks + 1, block_size, Hkv, D)   # [layer, k|v, block, slot, head, dim]

Block `num_blocks` (the last) is never lent: it is zero and pads block tables of different
lengths, with its keys marked invisible by position. A key that is masked out (a slot past a
sequence's end, a padding block) must still be a finite number: masked attention multiplies it by
0, and 0 * NaN is not 0. The arena is allocated with torch.empty (on Linux, pages of blocks never
written are not resident, so memory follows the blocks in use), and the engine zeroes a block
when a sequence starts filling it (zero_blocks), so the unwritten tail of a block is zeros.

A sequence's blocks on this rank are generally not adjacent, so attention reads them with
gather(): one indexed copy per layer of the blocks a step needs, as a (B, blocks * block_size,
Hkv, D) batch that tree_decode / ring_decode take as this rank's shard.
"""

from __future__ import annotations

import torch


class PagedKVCache:
    """This rank's pool of KV blocks, for every layer.

    Args:
        num_layers, num_kv_heads, head_dim: of the model.
        num_blocks: blocks this rank lends (the driver's BlockPool of this rank has as many).
        block_size: tokens per block.
        dtype, device: of the stored keys and values.
    """

    def __init__(self, *, num_layers: int, num_kv_heads: int, head_dim: int, num_blocks: int, block_size: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> None:
        for name, value in (("num_layers", num_layers), ("num_kv_heads", num_kv_heads), ("head_dim", head_dim), ("block_size", block_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 0:
            raise ValueError(f"num_blocks must be an int >= 0, got {num_blocks!r}")
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.num_blocks, self.block_size = num_blocks, block_size
        self.pad_block = num_blocks
        self.arena = torch.empty(num_layers, 2, num_blocks + 1, block_size, num_kv_heads, head_dim, dtype=dtype, device=device)
        self.arena[:, :, self.pad_block].zero_()

    @property
    def dtype(self) -> torch.dtype:
        return self.arena.dtype

    @property
    def device(self) -> torch.device:
        return self.arena.device

    def zero_blocks(self, blocks: torch.Tensor) -> None:
        """Zero the keys and values of `blocks`, int64 (n,) block ids, in every layer."""
        self.arena.index_fill_(2, blocks, 0)

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store keys and values of n tokens.

        Args:
            layer: layer index.
            slots: int64 (n,) flat slot of each token: block * block_size + offset in the block.
            k, v: (n, Hkv, D) in the cache's dtype.
        """
        kv = self.arena[layer].view(2, -1, self.num_kv_heads, self.head_dim)
        kv[0].index_copy_(0, slots, k)
        kv[1].index_copy_(0, slots, v)

    def gather(self, layer: int, table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of the blocks in `table`, int64 (B, nb) block ids (pad_block where a row
        has fewer): k, v (B, nb * block_size, Hkv, D), copies."""
        B, nb = table.shape
        kv = self.arena[layer][:, table]  # (2, B, nb, block_size, Hkv, D)
        kv = kv.view(2, B, nb * self.block_size, self.num_kv_heads, self.head_dim)
        return kv[0], kv[1]

    def nbytes(self) -> int:
        return self.arena.numel() * self.arena.element_size()

    def __repr__(self) -> str:
        return (f"PagedKVCache({self.num_blocks} blocks x {self.block_size} tokens, layers={self.num_layers}, "
                f"Hkv={self.num_kv_heads}, D={self.head_dim}, dtype={self.dtype})")
