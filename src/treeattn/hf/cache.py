"""ShardedCache: a transformers Cache that holds only this rank's shard of every layer's keys/values.

A transformers attention layer calls ``cache.update(k_new, v_new, layer_idx)`` on the model's cache with the
new tokens' keys and values (RoPE and q/k norms applied) and attends to what it gets back. This
cache stores the new tokens this rank owns (the placement policy decides, as in the engine:
treeattn.cache.placement) and returns this rank's whole shard, never the full cache. The keys'
absolute positions stay with the cache; the treeattn attention implementation
(treeattn.hf.attention) reads them there and combines the shards across ranks exactly.

Two phases, entered as context managers (they also bind the cache to the attention
implementation for the forward passes run inside them):

    cache = ShardedCache(model, capacity=prompt_len + max_new_tokens, group=group)
    with cache.prefill(prompt_ids) as part:                    # this rank's tokens of the prompt
        model(input_ids=part.input_ids, position_ids=part.position_ids, cache=cache)  # ring_attention
    with cache.decode():                                       # every rank runs the same tokens
        model(input_ids=next_ids, cache=cache)                   # tree_decode

(transformers before the rename takes the cache as ``past_key_values=cache``;
treeattn.hf.compat.cache_keyword(model) says which.)

get_seq_length() is the global number of tokens in the cache (the same on every rank), so
transformers' own position ids and generate() count as they would with the unsharded cache.
Storage is treeattn.cache.ShardedKVCache (one preallocated arena per rank, created at the first
update with the keys' dtype and device); sliding-window layers keep every token (the window is
applied by positions, exactly).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import NamedTuple

import torch
import torch.distributed as dist
from transformers.cache_utils import Cache, CacheLayerMixin

from treeattn.cache import ShardedKVCache
from treeattn.cache.placement import PLACEMENTS, make_placement
from treeattn.cache.sharded import SlotRange
from treeattn.hf.attention import bind_cache
from treeattn.parallel import comm
from treeattn.parallel.tree_decode import METHODS


class PrefillPart(NamedTuple):
    """What one rank runs of a sharded prefill.

    Attributes:
        input_ids: (B, S_r) the prompt tokens this rank holds; (B, 1) for a placeholder.
        position_ids: int64 (B, S_r) their absolute positions.
        placeholder: this rank holds none of the tokens. transformers' models cannot run zero
            tokens, yet every rank must take part in each layer's ring_attention: the rank runs
            one placeholder token whose keys are not stored and whose outputs mean nothing.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    placeholder: bool


class ShardedCache(Cache):
    """This rank's shard of a sequence-sharded KV cache, in transformers' Cache interface.

    Args:
        model: the transformers causal LM (its config gives the layer count; its parameters the
            device). The same model on every rank of `group`.
        capacity: total tokens per sequence the cache can hold, over all ranks (prompt plus new).
        batch_size: B, sequences decoded together (same length each: no padding).
        group: process group whose ranks share the cache; None is the default world group (or a
            single process when torch.distributed is not initialized).
        placement: "contiguous" (rank r holds the r-th span of ceil(capacity / p) tokens) or
            "interleaved" (blocks of block_size tokens dealt round-robin).
        block_size: tokens per block of the arena (and of dealing, for "interleaved").
        method: tree_decode's combine: "allreduce", "tree" or "twolevel".
        topology: treeattn.Topology for "twolevel"; None reads LOCAL_WORLD_SIZE.
    """

    def __init__(
        self,
        model,
        *,
        capacity: int,
        batch_size: int = 1,
        group: dist.ProcessGroup | None = None,
        placement: str = "contiguous",
        block_size: int = 256,
        method: str = "allreduce",
        topology=None,
    ) -> None:
        if placement not in PLACEMENTS:
            raise ValueError(f"placement must be one of {PLACEMENTS}, got {placement!r}")
        if method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {method!r}")
        num_layers = model.config.get_text_config().num_hidden_layers
        self.group = group
        # Without torch.distributed (one process) attention is plain ops.attention.
        self.distributed = group is not None or (dist.is_available() and dist.is_initialized())
        self.rank, self.world_size = (comm.group_rank(group), comm.group_size(group)) if self.distributed else (0, 1)
        self.placement = make_placement(placement, capacity, self.world_size, block_size)  # validates the ints
        self.batch_size_, self.block_size, self.method, self.topology = batch_size, block_size, method, topology
        self.model_class = type(model).__name__
        self.shard: ShardedKVCache | None = None  # created at the first update (dtype, device, Hkv, D)
        self.phase: str | None = None  # "prefill" or "decode" inside the context managers
        self.written = [0] * num_layers  # global tokens stored so far, per layer
        self.length = 0  # global tokens claimed (every layer reaches it within a forward pass)
        self._slots: SlotRange | None = None  # the tokens of the forward pass in progress
        self._prefill_positions: torch.Tensor | None = None  # int64 (S,) of the prompt being prefilled
        self._query_positions: torch.Tensor | None = None  # int64 (S_rank,) the queries this rank runs
        self._returned: list[torch.Tensor | None] = [None] * num_layers  # the key view given to each layer
        self._checked: set[tuple[str, int]] = set()  # (phase, layer) whose first call compared the ranks
        self.placeholder = False  # in a prefill block: this rank runs a placeholder token (PrefillPart)
        super().__init__(layers=[_ShardedLayer(self, i) for i in range(num_layers)])

    # ------------------------------------------------------------------ phases

    @contextlib.contextmanager
    def prefill(self, input_ids: torch.Tensor) -> Iterator[PrefillPart]:
        """Sharded prefill of `input_ids` (B, S), the same on every rank, appended after the tokens
        already cached. Yields this rank's PrefillPart (its tokens and their absolute position ids);
        run the model once on them inside the block, on every rank. Attention is ring_attention
        across the ranks (causal by absolute positions, each layer's window and softcap applied)."""
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.shape[0] != self.batch_size_:
            shape = tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
            raise ValueError(f"input_ids must be a (B={self.batch_size_}, S) tensor, got {shape}")
        positions = torch.arange(self.length, self.length + input_ids.shape[1], dtype=torch.int64)
        self._check_room(positions.numel())
        mine = torch.nonzero(self.placement.owner(positions) == self.rank).flatten()
        self._prefill_positions = positions
        self.placeholder = mine.numel() == 0
        if self.placeholder:  # one token to run, none to store
            mine = torch.zeros(1, dtype=torch.int64)
        with self._phase("prefill"):
            yield PrefillPart(input_ids[:, mine.to(input_ids.device)],
                              positions[mine].to(input_ids.device).expand(self.batch_size_, -1), self.placeholder)
        if positions.numel() and self.length < int(positions[-1]) + 1:
            raise RuntimeError("the cache.prefill() block ran no forward pass through the cache (run the model inside it)")

    @contextlib.contextmanager
    def decode(self) -> Iterator[None]:
        """Forward passes inside this block run the same new tokens on every rank (positions
        continue from get_seq_length()); each layer's attention is tree_decode over the shards."""
        with self._phase("decode"):
            yield

    @contextlib.contextmanager
    def _phase(self, phase: str) -> Iterator[None]:
        if self.phase is not None:
            raise RuntimeError(f"ShardedCache is already in its {self.phase} block; phases do not nest")
        self.phase = phase
        try:
            with bind_cache(self):
                yield
        finally:
            self.phase, self._prefill_positions, self.placeholder = None, None, False

    # ------------------------------------------------------------------ what update() and attention use

    def store(self, layer: int, key_states: torch.Tensor, value_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Cache.update for one layer: store the new tokens this rank owns, return this rank's shard.

        Args:
            key_states: (B, Hkv, S, D), value_states: (B, Hkv, S, D): the forward pass's new tokens
                (all of them in decode; this rank's part of the prompt in prefill).

        Returns:
            keys, values: (B, Hkv, L, D) views of this rank's L stored tokens of `layer`.
        """
        if self.phase is None:
            raise RuntimeError(
                f"ShardedCache.update outside its phases: run {self.model_class} inside `with cache.prefill(ids):` "
                "or `with cache.decode():` (tahf.generate does this)"
            )
        B, Hkv, S, D = key_states.shape
        if value_states.shape[-1] != D:
            raise NotImplementedError(
                f"{self.model_class}: keys of head dim {D} with values of head dim {value_states.shape[-1]} "
                "(e.g. multi-head latent attention) are not supported by treeattn.hf"
            )
        if B != self.batch_size_:
            raise ValueError(f"the forward pass has batch size {B}, the cache was built for batch_size={self.batch_size_}")
        if self.shard is None:
            self.shard = ShardedKVCache(
                num_layers=len(self.written), num_kv_heads=Hkv, head_dim=D, capacity=self.placement.capacity,
                batch_size=B, placement=self.placement.kind, block_size=self.block_size, rank=self.rank,
                world_size=self.world_size, dtype=key_states.dtype, device=key_states.device,
            )
        slots = self._slots_for(layer, S)
        k_new, v_new = key_states.transpose(1, 2), value_states.transpose(1, 2)  # (B, S, Hkv, D)
        if self.phase == "decode" or self.placeholder:  # keep only the new tokens this rank owns
            index = slots.owned.to(k_new.device)
            k_new, v_new = k_new.index_select(1, index), v_new.index_select(1, index)
        self.shard.write(layer, slots, k_new.to(self.shard.dtype), v_new.to(self.shard.dtype))
        self.written[layer] = slots.stop
        k, v = self.shard.layer(layer)
        self._returned[layer] = k.transpose(1, 2)
        return self._returned[layer], v.transpose(1, 2)

    def attention_inputs(self, layer: int, key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """For the attention of `layer` right after its update: (q_pos int64 (S,), kv_pos int64
        (B, L), check) where check says whether the ranks should compare their inputs first (the
        first call of each phase and layer)."""
        if self._returned[layer] is None or key is not self._returned[layer]:
            raise RuntimeError(
                f"{self.model_class} layer {layer}: the keys given to the treeattn attention are not this "
                "ShardedCache's shard; pass the cache to the model (cache=cache, past_key_values=cache before transformers "
                "renamed it)"
            )
        check = (self.phase, layer) not in self._checked
        self._checked.add((self.phase, layer))
        return self._query_positions.to(key.device), self.shard.kv_pos, check

    # ------------------------------------------------------------------ internals

    def _slots_for(self, layer: int, num_tokens: int) -> SlotRange:
        """The SlotRange of the forward pass in progress; the first layer to store claims it."""
        if self.written[layer] == self.length:  # a new forward pass
            if self.phase == "prefill":
                positions = self._prefill_positions
                if positions is None or positions[0].item() != self.length:
                    raise RuntimeError("one forward pass per cache.prefill() block: open a new block for more tokens")
            else:
                positions = torch.arange(self.length, self.length + num_tokens, dtype=torch.int64)
            self._check_room(positions.numel())
            self._slots = self.shard.extend(positions)
            self.length = self._slots.stop
            owned = self._slots.owned
            self._query_positions = positions[owned] if self.phase == "prefill" else positions
        slots = self._slots
        expected = slots.num_tokens if self.phase == "decode" else max(slots.num_owned, int(self.placeholder))
        if self.written[layer] != slots.start or num_tokens != expected:
            raise RuntimeError(
                f"{self.model_class} layer {layer} stores {num_tokens} tokens after {self.written[layer]}, but the forward "
                f"pass in progress holds tokens {slots.start}..{slots.stop - 1} ({expected} for this rank to run)"
            )
        return slots

    def _check_room(self, num_tokens: int) -> None:
        if self.length + num_tokens > self.placement.capacity:
            raise ValueError(
                f"ShardedCache full: capacity={self.placement.capacity} tokens, {self.length} in use, "
                f"{num_tokens} more requested"
            )

    # ------------------------------------------------------------------ transformers' Cache interface

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.written[layer_idx] if layer_idx < len(self.written) else 0

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        return self.get_seq_length(layer_idx) + query_length, 0

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return self.placement.capacity

    @property
    def batch_size(self) -> int:
        return self.batch_size_

    def _unsupported(self, what: str):
        raise NotImplementedError(f"ShardedCache does not support {what} (beam search, assisted decoding, cache edits)")

    def reorder_cache(self, beam_idx):
        self._unsupported("reorder_cache")

    def crop(self, tokens_to_remove: int):
        self._unsupported("crop")

    def batch_repeat_interleave(self, repeats: int):
        self._unsupported("batch_repeat_interleave")

    def batch_select_indices(self, indices):
        self._unsupported("batch_select_indices")

    def __repr__(self) -> str:
        return f"ShardedCache(model={self.model_class}, method={self.method}, shard={self.shard!r})"


class _ShardedLayer(CacheLayerMixin):
    """One layer of a ShardedCache, as transformers sees it; the parent holds the state."""

    is_sliding = False  # sliding layers keep every token too: the window is applied by positions

    def __init__(self, parent: ShardedCache, layer: int) -> None:
        super().__init__()
        self.parent, self.layer = parent, layer
        self.is_initialized = True

    def lazy_initialization(self, key_states, value_states) -> None:
        pass

    def update(self, key_states, value_states, *args, **kwargs):
        return self.parent.store(self.layer, key_states, value_states)

    def get_seq_length(self) -> int:
        return self.parent.written[self.layer]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_max_length(self) -> int:
        return self.parent.placement.capacity

    def reset(self) -> None:
        self.parent._unsupported("reset")

    def reorder_cache(self, beam_idx) -> None:
        self.parent._unsupported("reorder_cache")
