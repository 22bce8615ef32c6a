"""PagedBatch: one engine step's tokens on one rank, and the kv_store / attend the model calls for them.

    batch = PagedBatch(plan, rank, cache, attend, combine, phases)     # runner.RankRunner.step builds one
    logits = model(tokens, positions, kv_store=batch.kv_store, attend=batch.attend)

The step's tokens of all sequences form one flat row (1, T), whatever their sequences and positions:

- kv_store writes the new keys/values of the tokens whose blocks this rank holds (the block
  table names the rank of every block) and gathers, per group of sequences, this rank's blocks
  of each sequence as its shard (B, blocks * block_size, Hkv, D), with every key's position
  (slots past a sequence's end and padding blocks get INVISIBLE_POSITION);
- attend regroups the flat queries per sequence: decoding sequences (one token, and its drafts
  under speculative decoding) form one batch (B, 1 + most drafts), sequences running a prompt
  chunk another (B, Smax), each padded with queries at position -1 that see nothing. Each group
  makes one call of the rank's attention back end (tree_decode / ring_decode across the ranks,
  plain attention on one rank): a decode-only step, drafts or not, is one tree_decode per layer
  for the whole batch.

Decoding groups (tree and local decoding, no sliding window; float32 on the CPU with numba, CUDA
with triton) read their blocks in place with the paged decode kernel (treeattn.ops.paged_decode): the
group's block table and key positions are checked once per step (a PagedDecodeLayout), and each
layer makes one kernel call over the arena's blocks (no gather, no GQA repeat), then one combine
across the ranks. The reads below serve every other group (prefill chunks, other dtypes and devices,
no numba).

Reading a shard without copying it ("runs"): a sequence's blocks on this rank are often
physically adjacent (blocks are handed out in order, and a long prompt takes many at once). Each
sequence's local blocks, in logical order, are one run: one attention call (a view of the arena
where they are physically adjacent), then one combine_states across the ranks (the combine step of
tree_decode) finishes the group. Where they are not adjacent (the pool hands out freed blocks first
in, first out, so a later request's blocks can wrap around the pool's end; a prompt's blocks served
by the prefix cache) the run is gathered into a copy of the same shape first: the attention sees
the same keys in the same order and gives the same bits whatever blocks the sequence got. Until
session 24 each physically adjacent stretch was its own call, the states merged, so the rounding
depended on where a break fell: two prefills of one 8K prompt differed by 1.2e-5 in a logprob. A
group is read this way, without the batched gather's padded copy of every shard, when its runs
average at least COPY_FREE_MIN_KEYS keys (tree and local decoding, no sliding window; ring_decode
passes the shard itself, so it always gathers).

Shared prefixes: decoding sequences whose block tables begin with the same blocks (a document in
the prefix cache that several requests question) read those blocks once per step for all their
query rows, then each its own blocks; the states merge, then one combine across the ranks
(treeattn.engine.worker.shared_prefix; same conditions as run-by-run reads).

A hybrid cache's window layers (treeattn.cache.window) are attended locally on every rank, no combine.
The runner (runner.py) and the draft model's runner (draft.py) both run their steps through one.
"""

from __future__ import annotations

import time

import torch

from treeattn.cache.blocks import tokens_to_blocks
from treeattn.cache.paged import PagedKVCache
from treeattn.cache.window import WindowKVCache
from treeattn.cache.sharded import INVISIBLE_POSITION
from treeattn.engine.worker import shared_prefix
from treeattn.engine.scheduler import Chunk, StepPlan
from treeattn.models.attention import LocalAttention, group_world_size
from treeattn.ops import attention, merge_states_list
from treeattn.ops.cpu_decode import decode_attention
from treeattn.ops.paged_decode import PagedDecodeLayout, kernel_takes, layer_call, paged_decode_attention


# A group of sequences is read run by run (no copy) when its runs of adjacent blocks average at
# least this many keys; below, one gather and one batched call are cheaper (benchmarks/engine/engine_paged_read.py).
COPY_FREE_MIN_KEYS = 1024
_LOCAL = LocalAttention()  # a hybrid cache's window layers: every rank attends alone


class _Group:
    """Sequences attended in one call: their queries' rows in the flat step and their shards.
    own_from: per chunk, the first logical block of its shard (the blocks before are read as
    shared segments, treeattn.engine.worker.shared_prefix); None: from block 0."""

    def __init__(self, chunks: list[Chunk], offsets: list[int], rank: int, cache: PagedKVCache, device, copy_free_ok: bool,
                 own_from: list[int] | None = None, paged: bool = False) -> None:
        bs = cache.block_size
        width = max(len(c.tokens) for c in chunks)
        local = []  # per chunk: [(logical block, local block id)] of the blocks this rank holds
        for c, skip in zip(chunks, own_from or [0] * len(chunks)):
            used = tokens_to_blocks(c.start + len(c.tokens), bs)
            local.append([(j, ref.index) for j, ref in enumerate(c.blocks[:used]) if ref.rank == rank and j >= skip])
        nb = max(len(blocks) for blocks in local)
        q_index = torch.zeros(len(chunks), width, dtype=torch.int64)
        q_pos = torch.full((len(chunks), width), -1, dtype=torch.int64)
        table = torch.full((len(chunks), nb), cache.pad_block, dtype=torch.int64)
        kv_pos = torch.full((len(chunks), nb * bs), INVISIBLE_POSITION, dtype=torch.int64)
        for b, (c, offset, blocks) in enumerate(zip(chunks, offsets, local)):
            n, end = len(c.tokens), c.start + len(c.tokens)
            q_index[b, :n] = torch.arange(offset, offset + n)
            q_pos[b, :n] = torch.arange(c.start, end)
            if blocks:
                logical, ids = torch.tensor(blocks, dtype=torch.int64).unbind(1)
                table[b, : len(blocks)] = ids
                pos = (logical[:, None] * bs + torch.arange(bs)).flatten()  # every slot's position
                kv_pos[b, : len(blocks) * bs] = torch.where(pos < end, pos, INVISIBLE_POSITION)
        self.valid = (q_pos >= 0).to(device)
        # every query row is real and the rows are 0, 1, ... in order: the step's rows, viewed as (B, S)
        self.in_order = bool((q_pos >= 0).all()) and torch.equal(q_index.flatten(), torch.arange(q_index.numel()))
        self.q_index, self.q_pos = q_index.to(device), q_pos.to(device)
        self.table, self.kv_pos = table.to(device), kv_pos.to(device)
        self.runs = [_runs(blocks, kv_pos[b], bs, device) for b, blocks in enumerate(local)]
        num_runs = sum(len(r) for r in self.runs)
        keys = sum(len(blocks) for blocks in local) * bs
        self.copy_free = copy_free_ok and num_runs > 0 and keys >= COPY_FREE_MIN_KEYS * num_runs
        # Decoding groups read their blocks in place with the paged kernel (checked here, once per step).
        self.paged = PagedDecodeLayout(self.table, self.kv_pos, self.q_pos, block_size=bs) if paged else None
        self.layer_call = None  # the paged CPU kernel's call for every layer (ops.paged_decode.layer_call; False: none)
        self.shared = None  # the SharedSegments of a decoding group whose sequences share blocks


def _runs(blocks: list[tuple[int, int]], kv_pos: torch.Tensor, bs: int, device) -> list[tuple[object, int, torch.Tensor]]:
    """One sequence's local `blocks` [(logical, block id)], in logical order, as one run (none without blocks):
    [(where, number of blocks, int64 (1, keys) positions of their keys)]. `where` is the first block id when the blocks
    are physically adjacent (read as a view of the arena), else an int64 (1, n) table of their ids (gathered: the same
    keys in the same order, so the same bits whatever blocks the sequence got). The positions are the n * bs slots
    less the trailing unwritten ones (INVISIBLE_POSITION: a last block not yet full), so that a prompt chunk over
    positions 0, 1, ... takes attention's causal path over contiguous positions (no mask) rather than a masked pass
    over the slots no query sees; a rank's blocks under interleaved placement (logical 0, 2, 4, ...) are one run too,
    their positions with gaps (a masked call, as a gathered group's).

    >>> import torch
    >>> from treeattn.engine.worker.batch import INVISIBLE_POSITION, _runs
    >>> pos = torch.tensor([0, 1, 2, 3, 4, 5, 6, INVISIBLE_POSITION])  # 4 blocks of 2 slots, the last half written
    >>> [(where, n, p.tolist()) for where, n, p in _runs([(0, 3), (1, 4), (2, 5), (3, 6)], pos, 2, "cpu")]
    [(3, 4, [[0, 1, 2, 3, 4, 5, 6]])]
    >>> [(where.tolist(), n) for where, n, _ in _runs([(0, 5), (1, 6), (2, 9), (3, 2)], pos, 2, "cpu")]  # not adjacent
    [([[5, 6, 9, 2]], 4)]
    """
    if not blocks:
        return []
    ids = [block for _, block in blocks]
    where = ids[0] if ids == list(range(ids[0], ids[0] + len(ids))) else torch.tensor([ids], dtype=torch.int64, device=device)
    pos = kv_pos[None, : len(blocks) * bs]
    written = (pos[0] != INVISIBLE_POSITION).nonzero()
    keys = int(written[-1]) + 1 if written.numel() else pos.shape[1]
    return [(where, len(blocks), pos[:, :keys].to(device))]


class PagedBatch:
    """One step's tokens on this rank, with the kv_store and attend the model calls.

    Args:
        plan: the step (chunks of single tokens first).
        rank: this rank in the group.
        cache: this rank's PagedKVCache.
        attend: the rank's attention back end (models.attention.attention_backend).
        combine: (group, method, ranks_per_node) of a run-by-run read's combine, or None.
        phases: a dict the step's seconds of attention go to: "attention" (this rank's local
            attention; with the back end's own combine on a gathered group) and "combine" (the
            cross-rank combine of a run-by-run read), added up over the layers.
        windows: a hybrid cache's window layers (treeattn.cache.window.WindowKVCache, the same on
            every rank): their keys and values are kept there per sequence and attended locally,
            with no combine across the ranks; `cache` then holds only the other layers, in order
            (paged_index: model layer -> cache layer). None: `cache` holds every layer.
        linear_states: a hybrid linear model's treeattn.linear.hybrid.SequenceStates (the same on
            every rank; the step runs every token on every rank): its linear layers call
            `batch.linear`, and the batch itself is their kv_store (`batch(layer, k, v)` is
            kv_store); `cache` then holds the softmax layers (paged_index).
    """

    def __init__(self, plan: StepPlan, rank: int, cache: PagedKVCache, attend, combine=None, phases: dict | None = None,
                 windows: WindowKVCache | None = None, paged_index: dict[int, int] | None = None, linear_states=None) -> None:
        device, bs = cache.device, cache.block_size
        self.cache, self.backend, self.combine = cache, attend, combine
        self.windows, self.paged_index, self.linear_states = windows, paged_index, linear_states
        self.chunks = plan.chunks
        self._window_layer = False
        self._world = None  # the combine group's size, looked up on the step's first combine
        self.phases = {} if phases is None else phases
        tokens, positions, offsets, rows, slots, fresh = [], [], [], [], [], []
        for c in plan.chunks:
            offsets.append(len(tokens))
            for i, pos in enumerate(range(c.start, c.start + len(c.tokens))):
                ref = c.blocks[pos // bs]
                if ref.rank == rank:
                    rows.append(len(tokens) + i)
                    slots.append(ref.index * bs + pos % bs)
                    if pos % bs == 0:  # a block's first token: the block is new to this sequence
                        fresh.append(ref.index)
            tokens.extend(c.tokens)
            positions.extend(range(c.start, c.start + len(c.tokens)))
        self.tokens = torch.tensor([tokens], dtype=torch.int64, device=device)
        self.positions = torch.tensor([positions], dtype=torch.int64, device=device)
        self.store_rows = torch.tensor(rows, dtype=torch.int64, device=device)
        self.store_slots = torch.tensor(slots, dtype=torch.int64, device=device)
        self.offsets = offsets
        if fresh:
            cache.zero_blocks(torch.tensor(fresh, dtype=torch.int64, device=device))
        decoding = [i for i, c in enumerate(plan.chunks) if c.decoding]
        prefill = [i for i, c in enumerate(plan.chunks) if not c.decoding]
        segments, own_from = [], None
        if combine is not None and len(decoding) > 1:  # blocks several decoding sequences share: read once
            segments, own_from = shared_prefix.find_segments([plan.chunks[i] for i in decoding], bs)
        self.shared_keys = shared_prefix.saved_keys(segments, bs)  # key reads per layer saved this step
        # decoding groups: the paged kernel
        paged = combine is not None and kernel_takes(cache.dtype, device, cache.compute_dtype)
        self.groups = [_Group([plan.chunks[i] for i in idx], [offsets[i] for i in idx], rank, cache, device, combine is not None,
                              own_from if idx is decoding and segments else None, paged and idx is decoding)
                       for idx in (decoding, prefill) if idx]
        self._members = [[(plan.chunks[i], offsets[i]) for i in idx] for idx in (decoding, prefill) if idx]  # per group
        self._in_order = len(self.groups) == 1 and self.groups[0].in_order and self.groups[0].q_index.numel() == len(tokens)
        self._store_all = rows == list(range(len(tokens)))  # every new key is stored here, in order: no row gather
        # what kv_store returns when no group gathers its shard (decoding through the paged kernel, or run by run)
        self._no_gather = None
        if all(g.copy_free or g.paged is not None for g in self.groups):
            self._no_gather = (None,) * len(self.groups), (None,) * len(self.groups), tuple(g.kv_pos for g in self.groups)
        self._q_shape = tuple(self.groups[0].q_index.shape) if self._in_order else None  # the in-order group's (B, S)
        if segments:
            g = self.groups[0]
            g.shared = shared_prefix.SharedSegments(segments, [plan.chunks[i] for i in decoding], [offsets[i] for i in decoding],
                                                    g.q_index.shape[1], rank, bs, device, COPY_FREE_MIN_KEYS)
        self._layer = 0

    def kv_store(self, layer: int, k_new: torch.Tensor, v_new: torch.Tensor):
        """Store this rank's new keys/values, k_new, v_new (1, T, Hkv, D); return per group this
        rank's shards: tuples of k, v (B_g, Sk_g, Hkv, D) and kv_pos int64 (B_g, Sk_g) (None for a
        group read run by run: attend then reads the arena of this layer directly). A window layer
        of a hybrid cache returns its kept rows and the new ones instead (_window_store)."""
        self._window_layer = self.windows is not None and layer in self.windows
        if self._window_layer:
            return self._window_store(layer, k_new[0], v_new[0])
        if self.paged_index is not None:
            layer = self.paged_index[layer]
        if self._store_all:
            self.cache.write(layer, self.store_slots, k_new[0], v_new[0])
        elif self.store_rows.numel():
            self.cache.write(layer, self.store_slots, k_new[0, self.store_rows], v_new[0, self.store_rows])
        self._layer = layer
        if self._no_gather is not None:
            return self._no_gather
        shards = [(None, None) if g.copy_free or g.paged is not None else self.cache.gather(layer, g.table) for g in self.groups]
        return tuple(k for k, _ in shards), tuple(v for _, v in shards), tuple(g.kv_pos for g in self.groups)

    __call__ = kv_store  # a hybrid linear model's kv_store is the batch itself (it needs .linear too)

    def linear(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, feature_maps) -> torch.Tensor:
        """A linear layer of a hybrid model: q (1, T, Hq, D), k, v (1, T, Hkv, D) of the whole step ->
        out (1, T, Hq, Dv), each sequence's rows from its own state (linear_states)."""
        start = time.perf_counter()
        out = q.new_empty(*q.shape[:-1], v.shape[-1])
        for c, o in zip(self.chunks, self.offsets):
            rows = slice(o, o + len(c.tokens))
            out[:, rows] = self.linear_states.attend(layer, c.seq_id, c.start, q[:, rows], k[:, rows], v[:, rows], feature_maps)
        self.phases["attention"] = self.phases.get("attention", 0.0) + time.perf_counter() - start
        return out

    def _window_store(self, layer: int, k_new: torch.Tensor, v_new: torch.Tensor):
        """A window layer's new keys/values k_new, v_new (T, Hkv, D) of the whole step go to the
        window cache, sequence by sequence; returns per group k, v (B_g, L_g, Hkv, D) and kv_pos
        (B_g, L_g): each sequence's rows (WindowKVCache.extend: its ring in a decode step), padded
        with invisible positions where their lengths differ."""
        ks, vs, positions = [], [], []
        for members in self._members:
            rows = [self.windows.extend(layer, c.seq_id, c.start, k_new[o : o + len(c.tokens)], v_new[o : o + len(c.tokens)])
                    for c, o in members]
            width = max(pos.numel() for _, _, pos in rows)
            if all(pos.numel() == width for _, _, pos in rows):  # decode steps: every ring has one size
                if len(rows) == 1:  # the ring itself, no copy
                    ks.append(rows[0][0][None])
                    vs.append(rows[0][1][None])
                    positions.append(rows[0][2][None])
                else:
                    ks.append(torch.stack([k_b for k_b, _, _ in rows]))
                    vs.append(torch.stack([v_b for _, v_b, _ in rows]))
                    positions.append(torch.stack([pos_b for _, _, pos_b in rows]))
                continue
            k = k_new.new_zeros(len(rows), width, *k_new.shape[1:])
            v = v_new.new_zeros(len(rows), width, *v_new.shape[1:])
            pos = torch.full((len(rows), width), INVISIBLE_POSITION, dtype=torch.int64, device=k_new.device)
            for b, (k_b, v_b, pos_b) in enumerate(rows):
                k[b, : pos_b.numel()], v[b, : pos_b.numel()], pos[b, : pos_b.numel()] = k_b, v_b, pos_b
            ks.append(k)
            vs.append(v)
            positions.append(pos)
        return tuple(ks), tuple(vs), tuple(positions)

    def attend(self, q: torch.Tensor, k, v, *, q_pos, kv_pos, window) -> torch.Tensor:
        """q (1, T, Hq, D) -> out (1, T, Hq, D): one back-end call (or one run-by-run read and one
        combine) per group of sequences; for a hybrid cache's window layer, one local attention
        call per group over what _window_store returned (every rank holds it all: no combine).
        A step that is one group with every row in order (a decode step without drafts) regroups
        nothing: its queries are a view of q and its output is the group's."""
        start, combined = time.perf_counter(), self.phases.get("combine", 0.0)
        flat = q[0]
        if self._in_order:  # q (1, T, Hq, D) is the group's (B, S, Hq, D), and its output is the step's
            o = self._attend_group(self.groups[0], flat, q.reshape(*self._q_shape, *q.shape[2:]), k[0], v[0], kv_pos[0], window)
            out = o.reshape(*q.shape[:3], o.shape[-1])
        else:
            out = flat.new_zeros(*flat.shape[:-1], self.cache.value_dim or flat.shape[-1])  # (T, Hq, Dv)
            for g, k_g, v_g, pos_g in zip(self.groups, k, v, kv_pos):
                o = self._attend_group(g, flat, flat[g.q_index], k_g, v_g, pos_g, window)
                out[g.q_index[g.valid]] = o[g.valid]
            out = out[None]
        local = time.perf_counter() - start - (self.phases.get("combine", 0.0) - combined)
        self.phases["attention"] = self.phases.get("attention", 0.0) + local
        return out

    def _attend_group(self, g: _Group, flat: torch.Tensor, q_g: torch.Tensor, k_g, v_g, pos_g, window) -> torch.Tensor:
        """Group g's queries q_g (B, S, Hq, D) (flat: the step's, (T, Hq, D)) over its keys -> out (B, S, Hq, Dv) in q's dtype."""
        if self._window_layer:
            if q_g.shape[1] == 1 and q_g.dtype == k_g.dtype:  # decoding: the CPU kernel's call that ops.attention makes
                decoded = decode_attention(q_g, k_g, v_g, scale=q_g.shape[-1] ** -0.5, q_pos=g.q_pos, kv_pos=pos_g, window=window)
                if decoded is not None:  # its checks are ops.attention's own on these engine-made tensors
                    return decoded[0]
            return _LOCAL(q_g, k_g, v_g, q_pos=g.q_pos, kv_pos=pos_g, window=window)
        if g.shared is not None:
            return self._attend_shared(g, flat, k_g, v_g, pos_g)
        if g.paged is not None:
            out = self._combine(*self._paged_state(g, q_g, window))
            return out if out.dtype == q_g.dtype else out.to(q_g.dtype)
        if g.copy_free:
            return self._attend_runs(g, q_g)
        return self.backend(q_g, k_g, v_g, q_pos=g.q_pos, kv_pos=pos_g, window=window)

    def _attend_shared(self, g: _Group, flat: torch.Tensor, k_g, v_g, pos_g) -> torch.Tensor:
        """Group g's queries over its shared segments (each read once for its sequences) and each
        sequence's own blocks, merged, then combined across the ranks (treeattn.engine.worker.shared_prefix).
        flat: (T, Hq, D) the step's queries. Returns out (B, S, Hq, Dv) in q.dtype."""
        q = flat[g.q_index]
        if g.paged is not None:
            out, lse = self._paged_state(g, q)
        elif g.copy_free:
            out, lse = self._local_runs(g, q)
        else:
            out, lse = attention(q, k_g, v_g, causal=True, q_pos=g.q_pos, kv_pos=pos_g)
        acc = torch.promote_types(q.dtype, torch.float32)  # the merges' dtype
        out, lse = g.shared.merge_into(out.to(acc), lse.to(acc), flat, self.cache, self._layer)
        return self._combine(out, lse).to(q.dtype)

    def _paged_state(self, g: _Group, q: torch.Tensor, window: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """q (B, S, Hq, D) of decoding group g over this rank's blocks (the layer's sliding window
        applied), read in place by the paged kernel (treeattn.ops.paged_decode): this rank's state,
        out (B, S, Hq, Dv) and lse (B, Hq, S) float32."""
        k, v = self.cache.blocks(self._layer)
        k_scales, v_scales = self.cache.block_scales(self._layer)  # an fp8 cache's, else None
        if g.layer_call is None:  # the step's first layer: the CPU kernel's call, checked once for every layer
            g.layer_call = layer_call(q, k, v, g.paged, k_scales=k_scales, v_scales=v_scales,
                                      views=self.cache.kernel_views) or False
        if g.layer_call:
            out, lse = g.layer_call(q, k, v, window, k_scales, v_scales)
        else:
            out, lse = paged_decode_attention(q, k, v, g.paged, window=window, k_scales=k_scales, v_scales=v_scales)
        if out.dtype == torch.float32 or out.dtype == torch.float64:
            return out, lse
        return out.to(torch.promote_types(out.dtype, torch.float32)), lse  # the Triton kernel's out is in q.dtype

    def _attend_runs(self, g: _Group, q: torch.Tensor) -> torch.Tensor:
        """q (B, S, Hq, D) of group g over this rank's runs of blocks, merged per sequence, then
        combined across the ranks. Returns out (B, S, Hq, Dv) in q.dtype."""
        return self._combine(*self._local_runs(g, q)).to(q.dtype)

    def _local_runs(self, g: _Group, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q (B, S, Hq, D) of group g over this rank's runs of blocks, merged per sequence: this
        rank's state, out (B, S, Hq, Dv) and lse (B, Hq, S), float32 (float64 for float64 q)."""
        B, S, Hq, D = q.shape
        Dv = self.cache.value_dim or D
        outs, lses = [], []
        # each run: views of the arena (converted or dequantized copies with a narrower kv_cache_dtype)
        for b, runs in enumerate(g.runs):
            states = [attention(q[b : b + 1], *(x[:, : pos.shape[1]] for x in self._run_keys(where, n)),
                                causal=True, q_pos=g.q_pos[b : b + 1], kv_pos=pos) for where, n, pos in runs]
            if not states:  # nothing of this sequence here: the merge's identity
                states = [(q.new_zeros(1, S, Hq, Dv), torch.full((1, Hq, S), float("-inf"), device=q.device))]
            o, lse = merge_states_list([o for o, _ in states], [lse for _, lse in states]) if len(states) > 1 else states[0]
            acc = torch.promote_types(o.dtype, torch.float32)
            outs.append(o.to(acc))
            lses.append(lse.to(acc))
        return torch.cat(outs), torch.cat(lses)

    def _run_keys(self, where, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One run's keys and values in this layer (see _runs), k (1, n * block_size, Hkv, D), v (..., Dv): views of
        the arena for adjacent blocks (cache.run), else a gathered copy of the same shape and strides (cache.gather)."""
        if isinstance(where, int):
            return tuple(x[None] for x in self.cache.run(self._layer, where, n))
        return self.cache.gather(self._layer, where)

    def paged_decode_group(self, *, windows: bool = False) -> _Group | None:
        """The step's group when the step is one group of decoding rows in the step's order whose blocks the paged
        kernel reads (no shared segments, no linear layers; no window layers, every layer in the cache, unless
        `windows`: a hybrid cache's window layers, which the caller stores and attends through kv_store and attend):
        what a compiled decode step (treeattn.engine.worker.compiled_decode) runs; else None."""
        hybrid = self.windows is not None or self.paged_index is not None
        if len(self.groups) != 1 or not self._in_order or self.linear_states is not None or (hybrid and not windows):
            return None
        g = self.groups[0]
        return g if g.paged is not None and g.shared is None else None

    def combine_size(self) -> int:
        """The ranks a decoding group's state is combined over (1: none; combine is not None for a paged group)."""
        if self._world is None:
            self._world = group_world_size(self.combine[0])
        return self._world

    def combine_state(self, out: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
        """_combine: this rank's state over every rank's keys (for treeattn.engine.worker.compiled_decode)."""
        return self._combine(out, lse)

    def _combine(self, out: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
        """This rank's state, out (B, S, Hq, Dv) and lse (B, Hq, S) float32 or float64 -> out over
        every rank's keys (tree_decode's combine step), same dtype."""
        group, method, ranks_per_node = self.combine
        if self._world is None:  # once per step: torch.distributed's state does not change within one
            self._world = group_world_size(group)
        if self._world > 1:
            from treeattn.parallel.tree_decode import combine_states

            start = time.perf_counter()
            out, lse = combine_states(out, lse, group=group, method=method, ranks_per_node=ranks_per_node)
            self.phases["combine"] = self.phases.get("combine", 0.0) + time.perf_counter() - start
        return out
