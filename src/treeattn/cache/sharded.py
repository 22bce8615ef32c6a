"""A sequence-sharded KV cache of one batch: each rank holds its shard of every layer's keys and values.

This is the cache of callers that run a model over one batch themselves: the transformers plug-in
(treeattn.hf.ShardedCache) and the tests' references. The engine (ta.Engine, ta.generate) keeps a
paged cache instead (treeattn.cache.paged, blocks.py), which its decode steps read in place with
the paged kernel (treeattn.ops.paged_decode) or by runs of adjacent blocks (treeattn.engine.worker.batch).

Storage on one rank is one arena of fixed-size blocks, preallocated for the cache's capacity:

    arena: (num_layers, 2, B, num_blocks * block_size, Hkv, D)   # [layer, k|v, batch, slot, head, dim]
           (num_layers, 1, B, num_blocks * block_size, Hkv, D)   # value_dim given: keys only, V = K[..., :value_dim]
    positions: int64 (B, num_blocks * block_size)                  # global position of each local slot

The placement policy (treeattn.cache.placement) decides which rank holds each global slot and fills
every rank's local slots in order, so the used blocks are always the prefix of the arena: attention
reads them as a view (no gather, no copy per step), and growth writes into the next free slots
without ever moving what is already there. The arena is allocated with torch.empty, so on Linux the
pages of blocks not yet written are not resident: memory in use follows the blocks in use.

Why one arena rather than a pool of blocks and a block table here: a decode step must read the
whole shard, and the dense CPU attention kernel wants each head's keys as one strided matrix. A
block table would make every step gather the shard into such a matrix first (a full copy of the
shard per layer per step; benchmarks/engine/engine_decode.py measures that gather against the view),
unless a paged kernel reads the blocks in place, as the engine's does.

Every global slot belongs to one token of every sequence in the batch. Sequences of different
lengths are left-padded: a padding slot gets position PAD_POSITION when written and is stored
with position INVISIBLE_POSITION, which no causal query can see.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from treeattn.cache.placement import Placement, make_placement
from treeattn.cache.positions import INVISIBLE_POSITION, PAD_POSITION
from treeattn.cache.window import paged_layers
from treeattn.ops.fp8 import FP8

logger = logging.getLogger(__name__)



@dataclass(frozen=True)
class SlotRange:
    """The global slots [start, stop) claimed by one ShardedKVCache.extend call, seen from one rank.

    Attributes:
        start, stop: global slots of the new tokens (token i of the call sits in slot start + i).
        local_start, local_stop: the local slots this rank stores them in.
        owned: int64 (local_stop - local_start,) ascending indices i in [0, stop - start) of the
            new tokens that this rank holds.
    """

    start: int
    stop: int
    local_start: int
    local_stop: int
    owned: torch.Tensor

    @property
    def num_tokens(self) -> int:
        return self.stop - self.start

    @property
    def num_owned(self) -> int:
        return self.local_stop - self.local_start


def kv_bytes_per_token(model_config, dtype: torch.dtype) -> int:
    """Bytes of KV cache one more token takes (positions not counted): keys and values of
    num_kv_heads x head_dim each, or keys only when model_config.cache_value_dim says the values
    are a view of them (MLA's latent cache), in every layer the sequence-sharded cache holds -- all
    layers, except the window layers of a hybrid model (treeattn.cache.window: a fixed cost per
    sequence, window_bytes_per_sequence). An fp8 cache (float8_e4m3fn) adds its float32 scale per
    token and KV head (treeattn.cache.paged): head_dim + 4 bytes per head."""
    planes = 1 if model_config.cache_value_dim else 2
    itemsize = torch.empty((), dtype=dtype).element_size()
    scale_bytes = 4 if dtype == FP8 else 0
    layers = len(paged_layers(tuple(model_config.layer_windows)))
    return layers * planes * model_config.num_kv_heads * (model_config.head_dim * itemsize + scale_bytes)


class ShardedKVCache:
    """This rank's shard of a sequence-sharded KV cache, for every layer.

    Args:
        num_layers: number of attention layers.
        num_kv_heads: Hkv.
        head_dim: D (keys and values share it, as in the Llama family).
        value_dim: None (values stored beside the keys, D channels each), or Dv <= D: the values are
            the first Dv channels of the keys and have no storage of their own (multi-head latent
            attention: one latent per token is both key and value, the RoPE key follows it).
        capacity: total number of global slots (tokens per sequence) over all ranks.
        batch_size: B, sequences decoded together (they share slots; shorter ones are left-padded).
        placement: "contiguous" or "interleaved" (see treeattn.cache.placement).
        block_size: slots per block: the unit of allocation, and of dealing for "interleaved".
        rank, world_size: this rank and the number of ranks sharing the cache.
        dtype, device: of the stored keys and values.

    Example (rank 1 of 2 with contiguous placement holds the second half of a 10-token sequence)::

        >>> import torch, treeattn as ta
        >>> cache = ta.ShardedKVCache(num_layers=2, num_kv_heads=2, head_dim=8, capacity=10, rank=1, world_size=2, block_size=4)
        >>> slots = cache.extend(torch.arange(10).unsqueeze(0))       # positions (B, S) of new tokens
        >>> slots.num_tokens, slots.num_owned, cache.kv_pos
        (10, 5, tensor([[5, 6, 7, 8, 9]]))
        >>> k, v = cache.layer(0)                                       # this rank's shard: (B, 5, Hkv, D) views
        >>> k.shape
        torch.Size([1, 5, 2, 8])
    """

    def __init__(
        self,
        *,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        capacity: int,
        value_dim: int | None = None,
        batch_size: int = 1,
        placement: str = "contiguous",
        block_size: int = 256,
        rank: int = 0,
        world_size: int = 1,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        for name, value in (("num_layers", num_layers), ("num_kv_heads", num_kv_heads), ("head_dim", head_dim),
                            ("batch_size", batch_size)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be an int, got {type(value).__name__}")
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if value_dim is not None and (isinstance(value_dim, bool) or not isinstance(value_dim,
                                                                                    int) or not 1 <= value_dim <= head_dim):
            raise ValueError(f"value_dim must be None or an int in [1, head_dim={head_dim}], got {value_dim!r}")
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
            raise ValueError(f"rank must be an int in [0, world_size={world_size}), got {rank!r}")
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise TypeError(f"dtype must be a floating torch.dtype, got {dtype!r}")
        self.placement: Placement = make_placement(placement, capacity, world_size, block_size)
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.value_dim = value_dim
        self.batch_size = batch_size
        self.rank = rank
        self.world_size = world_size
        self.block_size = block_size
        self.dtype = dtype
        self.device = torch.device(device)
        self.local_capacity = self.placement.local_capacity(rank)
        self.num_blocks = -(-self.local_capacity // block_size)
        slots = self.num_blocks * block_size
        self._arena = torch.empty(num_layers, 1 if value_dim else 2, batch_size, slots, num_kv_heads, head_dim, dtype=dtype,
                                  device=self.device)
        self._positions = torch.full((batch_size, slots), INVISIBLE_POSITION, dtype=torch.int64, device=self.device)
        self.length = 0  # global slots in use (the same on every rank)
        self.local_length = 0  # slots in use on this rank: the prefix [0, local_length)

    @property
    def capacity(self) -> int:
        return self.placement.capacity

    @property
    def blocks_used(self) -> int:
        return -(-self.local_length // self.block_size)

    @property
    def kv_pos(self) -> torch.Tensor:
        """int64 (B, local_length): global position of each stored token (INVISIBLE_POSITION for padding)."""
        return self._positions[:, : self.local_length]

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views (no copy) of this rank's keys and values of `layer`: k (B, local_length, Hkv, D),
        v (B, local_length, Hkv, Dv) (Dv = value_dim or D)."""
        self._check_layer(layer)
        return self._split(self._arena[layer, :, :, : self.local_length])

    def _split(self, kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(k, v) of a slice (planes, B, slots, Hkv, D) of the arena."""
        return (kv[0], kv[0][..., : self.value_dim]) if self.value_dim else (kv[0], kv[1])

    @property
    def bytes_per_token(self) -> int:
        """Bytes one token's keys and values take in all layers (positions not counted)."""
        return self.num_layers * self._arena.shape[1] * self.num_kv_heads * self.head_dim * self._arena.element_size()

    def nbytes(self) -> int:
        """Bytes of keys, values and positions this rank holds for the tokens in use."""
        return self.batch_size * self.local_length * (self.bytes_per_token + 8)

    def nbytes_reserved(self) -> int:
        """Bytes of the preallocated arena and positions (virtual; untouched blocks are not resident)."""
        return self._arena.numel() * self._arena.element_size() + self._positions.numel() * 8

    def check_room(self, num_tokens: int) -> None:
        """Raise ValueError if `num_tokens` more tokens do not fit. Changes nothing."""
        if self.length + num_tokens > self.capacity:
            raise ValueError(
                f"KV cache full: capacity is {self.capacity} tokens, {self.length} are in use, "
                f"cannot add {num_tokens} more (need capacity >= {self.length + num_tokens})"
            )

    def extend(self, positions: torch.Tensor) -> SlotRange:
        """Claim the next S global slots for S new tokens of every sequence.

        Checks everything before changing any state. Keys and values are then written per layer
        with write(); the model does that through a CacheUpdate.

        Args:
            positions: int64 (S,) or (B, S): the new tokens' positions in their sequences;
                PAD_POSITION (-1) marks a padding token, stored as never visible.

        Returns:
            The SlotRange of the new tokens on this rank.
        """
        positions = self._check_positions(positions)
        num_tokens = positions.shape[1]
        self.check_room(num_tokens)
        start, stop = self.length, self.length + num_tokens
        slots = torch.arange(start, stop, dtype=torch.int64)
        owned = torch.nonzero(self.placement.owner(slots) == self.rank).flatten()
        local_start = self.local_length
        local_stop = self.placement.local_length(self.rank, stop)
        assert local_stop - local_start == owned.numel(), "placement must fill local slots in order"
        stored = positions.index_select(1, owned.to(positions.device))
        stored = torch.where(stored == PAD_POSITION, torch.full_like(stored, INVISIBLE_POSITION), stored)
        self._positions[:, local_start:local_stop] = stored
        self.length, self.local_length = stop, local_stop
        return SlotRange(start, stop, local_start, local_stop, owned)

    def write(self, layer: int, slots: SlotRange, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store the keys and values of the tokens of `slots` that this rank holds.

        Args:
            layer: layer index.
            slots: a SlotRange returned by extend().
            k, v: (B, slots.num_owned, Hkv, D) and (B, slots.num_owned, Hkv, Dv) in the cache's dtype
                and device. With value_dim, v is not stored (it must be k[..., :value_dim]).
        """
        self._check_layer(layer)
        expected = (self.batch_size, slots.num_owned, self.num_kv_heads, self.head_dim)
        for name, t in (("k", k), ("v", v)):
            shape = expected[:3] + (self.value_dim,) if name == "v" and self.value_dim else expected
            if tuple(t.shape) != shape:
                raise ValueError(f"{name} must have shape (B, owned tokens, Hkv, {'Dv' if name == 'v' else 'D'}) = {shape}, got "
                                 f"{tuple(t.shape)}")
            if t.dtype != self.dtype:
                raise TypeError(f"{name} must have the cache's dtype {self.dtype}, got {t.dtype}")
        if slots.local_stop > self.local_length:
            raise ValueError(
                f"slots {slots.local_start}:{slots.local_stop} lie beyond the {self.local_length} local slots in use"
            )
        if slots.num_owned:
            self._arena[layer, 0, :, slots.local_start : slots.local_stop] = k
            if not self.value_dim:
                self._arena[layer, 1, :, slots.local_start : slots.local_stop] = v

    def truncate(self, length: int) -> None:
        """Forget every token from global slot `length` on (e.g. to decode again from a prefilled prompt)."""
        if isinstance(length, bool) or not isinstance(length, int) or not 0 <= length <= self.length:
            raise ValueError(f"length must be an int in [0, {self.length}], got {length!r}")
        self.length = length
        self.local_length = self.placement.local_length(self.rank, length)

    def update(self, slots: SlotRange, store_index: torch.Tensor | None = None) -> "CacheUpdate":
        """The CacheUpdate a model forward pass writes its new keys and values through."""
        return CacheUpdate(self, slots, store_index)

    # ------------------------------------------------------------------ static-shape decoding
    # A CUDA graph replays fixed shapes at fixed addresses, and a captured step must not read a
    # device value on the host. In static mode attention reads this rank's whole preallocated
    # shard (local_capacity slots; the unused ones at INVISIBLE_POSITION), and where a new token
    # goes is computed on the device from a device-side slot counter (treeattn.engine.worker.static_step).
    # The host keeps counting with advance(), which reads nothing from the device.

    def static_layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of every slot this rank can ever hold for `layer`: k, v (B, local_capacity, Hkv, D).
        Slots past local_length hold what clear_unused() left (zeros) until a static step writes them."""
        self._check_layer(layer)
        return self._split(self._arena[layer, :, :, : self.local_capacity])

    @property
    def static_kv_pos(self) -> torch.Tensor:
        """int64 (B, local_capacity): positions of every slot of static_layer(); INVISIBLE_POSITION where unused."""
        return self._positions[:, : self.local_capacity]

    def clear_unused(self) -> None:
        """Zero the keys and values of every slot from local_length on (all layers) and set their
        positions to INVISIBLE_POSITION.

        Static-mode attention reads these slots (masked by position): they must hold finite numbers,
        since a masked key still costs 0 * value and torch.empty may have left NaN there, and stale
        positions (after truncate()) must not be visible. On the CPU this makes the whole arena resident.
        """
        self._arena[:, :, :, self.local_length :].zero_()
        self._positions[:, self.local_length :] = INVISIBLE_POSITION

    def locate(self, slot: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Where global slot `slot` lives, computed on the device (no host read).

        Args:
            slot: int64 (1,) global slot index.

        Returns:
            local_slot: int64 (1,), the slot's index in this rank's storage if this rank holds it
                (otherwise some valid index, clamped into the storage).
            owned: bool (1,), whether this rank holds the slot.
        """
        owned = self.placement.owner(slot) == self.rank
        local_slot = self.placement.local_slot(slot).clamp(0, max(self.local_capacity - 1, 0))
        return local_slot, owned

    def store_positions_at(self, local_slot: torch.Tensor, owned: torch.Tensor, positions: torch.Tensor) -> None:
        """Device-side write of one token's positions, int64 (B,) or (B, 1), into local_slot if owned
        (locate()); a rank that does not hold the slot writes back what it had."""
        if self.local_capacity == 0:
            return
        new = positions.reshape(self.batch_size, 1)
        old = self._positions.index_select(1, local_slot)
        self._positions.index_copy_(1, local_slot, torch.where(owned, new, old))

    def store_at(self, layer: int, local_slot: torch.Tensor, owned: torch.Tensor, k_new: torch.Tensor,
                 v_new: torch.Tensor) -> None:
        """Device-side write of one token's keys and values of `layer`, k_new, v_new (B, 1, Hkv, D),
        into local_slot if owned (locate()); otherwise the slot keeps what it had."""
        self._check_layer(layer)
        if self.local_capacity == 0:
            return
        kv = self._arena[layer]  # (2 or 1, B, slots, Hkv, D)
        new = k_new[None] if self.value_dim else torch.stack((k_new, v_new))
        old = kv.index_select(2, local_slot)
        kv.index_copy_(2, local_slot, torch.where(owned, new, old))

    def advance(self, num_tokens: int) -> None:
        """Count `num_tokens` tokens that static-mode steps wrote on the device (host bookkeeping only)."""
        self.check_room(num_tokens)
        self.length += num_tokens
        self.local_length = self.placement.local_length(self.rank, self.length)

    def _check_layer(self, layer: int) -> None:
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < self.num_layers:
            raise ValueError(f"layer must be an int in [0, {self.num_layers}), got {layer!r}")

    def _check_positions(self, positions: torch.Tensor) -> torch.Tensor:
        if not isinstance(positions, torch.Tensor):
            raise TypeError(f"positions must be an int64 tensor, got {type(positions).__name__}")
        if positions.dtype != torch.int64:
            raise TypeError(f"positions must be int64, got {positions.dtype}")
        if positions.dim() == 1:
            positions = positions.unsqueeze(0).expand(self.batch_size, -1)
        if positions.dim() != 2 or positions.shape[0] != self.batch_size:
            raise ValueError(f"positions must have shape (S,) or (B={self.batch_size}, S), got {tuple(positions.shape)}")
        return positions

    def __repr__(self) -> str:
        return (
            f"ShardedKVCache(rank={self.rank}/{self.world_size}, placement={self.placement.kind}, "
            f"length={self.length}/{self.capacity}, local={self.local_length}/{self.local_capacity}, "
            f"blocks={self.blocks_used}/{self.num_blocks}x{self.block_size}, layers={self.num_layers}, "
            f"B={self.batch_size}, Hkv={self.num_kv_heads}, D={self.head_dim}, "
            + (f"Dv={self.value_dim} (a view of K), " if self.value_dim else "") + f"dtype={self.dtype})"
        )


class CacheUpdate:
    """How one forward pass stores its new tokens' keys and values, and what it attends to.

    The model calls update(layer, k_new, v_new) once per layer: the new tokens this rank holds are
    written into the cache, and the layer attends to everything this rank holds for that layer.

    Args:
        cache: this rank's ShardedKVCache.
        slots: the SlotRange of the new tokens (from cache.extend).
        store_index: which of the forward pass's input tokens are this rank's to store, as int64
            indices into its S inputs; None when every input token is one this rank holds (ring
            prefill, where each rank runs only its own tokens). For decoding, where every rank runs
            every new token, it is slots.owned.
    """

    def __init__(self, cache: ShardedKVCache, slots: SlotRange, store_index: torch.Tensor | None) -> None:
        self.cache = cache
        self.slots = slots
        self.store_index = store_index

    def __call__(self, layer: int, k_new: torch.Tensor, v_new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Store the new keys/values of `layer` and return this rank's (k, v, kv_pos) to attend to.

        Args:
            layer: layer index.
            k_new, v_new: (B, S, Hkv, D), the forward pass's new keys and values (RoPE applied).

        Returns:
            k, v: (B, local_length, Hkv, D) views of this rank's shard, new tokens included.
            kv_pos: int64 (B, local_length) their global positions.
        """
        if self.store_index is not None:
            index = self.store_index.to(k_new.device)
            k_new, v_new = k_new.index_select(1, index), v_new.index_select(1, index)
        self.cache.write(layer, self.slots, k_new, v_new)
        k, v = self.cache.layer(layer)
        return k, v, self.cache.kv_pos


class StaticCacheUpdate:
    """The kv_store of one static-shape decode step: one new token per sequence at a slot known only
    on the device (ShardedKVCache.locate), and attention over the whole preallocated shard.

    Args:
        cache: this rank's ShardedKVCache (clear_unused() called before the first static step).
        local_slot: int64 (1,), owned: bool (1,): from cache.locate(slot).
    """

    def __init__(self, cache: ShardedKVCache, local_slot: torch.Tensor, owned: torch.Tensor) -> None:
        self.cache = cache
        self.local_slot = local_slot
        self.owned = owned

    def __call__(self, layer: int, k_new: torch.Tensor, v_new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Store k_new, v_new (B, 1, Hkv, D) of `layer` if this rank holds the slot; return k, v
        (B, local_capacity, Hkv, D) and kv_pos int64 (B, local_capacity), the same shapes every step."""
        self.cache.store_at(layer, self.local_slot, self.owned, k_new, v_new)
        k, v = self.cache.static_layer(layer)
        return k, v, self.cache.static_kv_pos
