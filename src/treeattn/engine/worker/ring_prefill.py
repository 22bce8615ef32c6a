"""Ring prefill steps: a step of prompt chunks only, its rows spread evenly (zigzag) over the ranks.

A token-parallel step (treeattn.engine.worker.token_parallel) cuts the step's flat row (1, T) into p
contiguous slices, but then every rank attends ALL T queries to its own shard and the states are
combined: attention stays where the keys are. With contiguous placement a single prompt's keys sit
on one rank after the other, so rank 0 does most of a prompt's attention while the others wait in
the combines (docs/benchmarks.md, "Token-parallel prefill in the engine"). ta.generate's former ring
prefill (each rank ran its own tokens with ring_attention) had the same causal imbalance: the rank
holding the last span attends to every key.

A ring prefill step balances both the model's work and the attention's. Every chunk of the step
(one sequence's prompt tokens at positions start .. start + n - 1) is cut into 2p near-equal
pieces, and rank r runs pieces r and 2p - 1 - r (zigzag_pieces; the load-balanced layout of ring
attention implementations): every rank gets n / p rows, and since a query at offset i attends to
start + i + 1 keys, the pairs of pieces cost the same attention on every rank. The model is
unchanged and knows nothing of ranks; the injected callables do the distribution, per layer:

    kv_store(layer, k_r, v_r)   k_r, v_r: (1, T_r, Hkv, D) this rank's rows' new keys/values.
        All-gather the rows -> k, v (1, T, Hkv, D) in the step's flat order, on every rank; write
        the tokens whose blocks this rank holds into its cache (PagedBatch.store_rows/store_slots).
    attend(q_r, ...)            q_r: (1, T_r, Hq, D) this rank's queries (RoPE applied).
        Per chunk, two exact states merged with merge_states:
        - the chunk's new keys: every rank now has all of them, so each piece [lo, hi) of the
          chunk attends locally to the chunk's keys [0, hi), causal over contiguous positions
          (ops.attention's fused causal path, no mask built);
        - the sequence's cached prefix (positions < start: earlier chunks, or a prefix-cache hit),
          held by the ranks that own its blocks: ring_attention of this rank's queries of the
          chunk over every rank's prefix keys, K/V rotating (treeattn.parallel.ring). Every
          prefix key precedes every query, so each block is an unmasked attention.
        Returns this rank's rows of the output, (1, T_r, Hq, Dv).

Communication per layer: one all-gather of the step's keys and values together ((p - 1) / p of T * 2 *
Hkv * D elements received per rank; Hkv * D for MLA's latent cache, whose values are a view of
its keys), and for each chunk with a cached prefix one ring of p - 1 steps passing the prefix
shards. No queries are gathered and nothing is combined. At the end the final hidden states of the
rows that sample are gathered to every rank (one all-gather of a few rows), as in a token-parallel
step, and rank 0 computes the logits.

A hybrid model's window layers (Gemma 3; treeattn.cache.window) keep their last W - 1 positions
per sequence on every rank: kv_store's all-gather already gives every rank all the step's keys and
values, so a window layer stores them in the window cache instead of the paged arena, and attend
runs this rank's queries over what it returns (the kept positions and the chunk's), a local call:
no prefix ring and no combine.

The runner uses a ring step for a step of prompt chunks only (no decoding sequence: those attend
to their whole cache, which a ring would move every step) that token_parallel.splits, when the
engine's prefill option resolves to "ring" (resolve_prefill). While no sequence decodes, the
scheduler then gives a step up to RING_ROWS_PER_RANK prompt tokens per rank instead of
prefill_chunk (idle_prefill_chunk): no decoder waits, and fewer, larger steps pass fewer prefixes
around the ring.
"""

from __future__ import annotations

import torch

from treeattn.cache.blocks import tokens_to_blocks
from treeattn.engine.worker.token_parallel import gather_rows, gather_slices
from treeattn.ops import attention, merge_states


def zigzag_pieces(n: int, world_size: int, rank: int) -> list[tuple[int, int]]:
    """The rows [lo, hi) of a chunk of `n` tokens that `rank` runs: pieces rank and 2p - 1 - rank of
    2p near-equal contiguous pieces (one range when they touch, none empty).

    Every rank gets n / p rows up to rounding, and the sum of its rows' offsets (the causal
    attention they do) is the same on every rank up to rounding."""
    p = world_size
    bounds = [i * n // (2 * p) for i in range(2 * p + 1)]
    first, second = (bounds[rank], bounds[rank + 1]), (bounds[2 * p - 1 - rank], bounds[2 * p - rank])
    pieces = [(first[0], second[1])] if first[1] == second[0] else [first, second]
    return [(lo, hi) for lo, hi in pieces if hi > lo]


class _ChunkRows:
    """One chunk of the step as this rank sees it: its pieces, and its cached prefix on this rank."""

    def __init__(self, chunk, offset: int, pieces: list[tuple[int, int]], first_row: int, rank: int, cache, device) -> None:
        bs = cache.block_size
        self.offset, self.start, self.pieces = offset, chunk.start, pieces
        self.first_row = first_row  # of its rows in this rank's slice
        self.num_rows = sum(hi - lo for lo, hi in pieces)
        self.q_pos = [torch.arange(self.start + lo, self.start + hi, device=device)[None] for lo, hi in pieces]
        self.kv_pos = [torch.arange(self.start, self.start + hi, device=device)[None] for _, hi in pieces]
        self.q_pos_all = torch.cat(self.q_pos, dim=1) if pieces else torch.empty(1, 0, dtype=torch.int64, device=device)
        # The prefix (positions < start) this rank holds: its blocks of the sequence before the
        # chunk, the last one possibly partial (it is the sequence's last prefix block).
        local = [(j, ref.index) for j, ref in enumerate(chunk.blocks[: tokens_to_blocks(chunk.start, bs)]) if ref.rank == rank]
        self.has_prefix = chunk.start > 0  # on some rank: every rank takes part in its ring
        self.prefix_keys = sum(min(bs, chunk.start - j * bs) for j, _ in local)
        positions = [torch.arange(j * bs, min((j + 1) * bs, chunk.start)) for j, _ in local]
        self.prefix_pos = (torch.cat(positions) if positions else torch.empty(0, dtype=torch.int64))[None].to(device)
        ids = [index for _, index in local]
        adjacent = all(b == a + 1 for a, b in zip(ids, ids[1:]))
        self.prefix_run = (ids[0], len(ids)) if ids and adjacent else None  # read as a view: no copy
        self.prefix_table = torch.tensor([ids], dtype=torch.int64, device=device) if ids else None

    def prefix(self, cache, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's prefix keys and values of the chunk's sequence: (1, prefix_keys, Hkv, D), (..., Dv)."""
        n = self.prefix_keys
        if self.prefix_run is not None:
            k, v = cache.run(layer, *self.prefix_run)  # in the model's dtype (a view, unless the cache stores another)
            return k[None, :n], v[None, :n]
        if self.prefix_table is None:
            k, v = cache.run(layer, 0, 0)
            return k[None], v[None]
        k, v = cache.gather(layer, self.prefix_table)
        return k[:, :n], v[:, :n]


class RingPrefillStep:
    """One prompt-only step of a PagedBatch run as a ring prefill (see the module docstring).

    Args:
        batch: the step's PagedBatch (treeattn.engine.worker.batch): all T tokens, their positions and
            the cache writes of this rank.
        chunks: the step's chunks (plan.chunks, none decoding), in the batch's order.
        rank, world_size: this rank in the group, and its size p.
        group: the process group (or SharedMemoryGroup) of the collectives and of the rings.

    Attributes:
        rows: int64 (T_r,) the flat rows this rank runs, chunk by chunk (zigzag_pieces of each).
        tokens, positions: int64 (1, T_r): batch.tokens / batch.positions at those rows.
    """

    def __init__(self, batch, chunks, rank: int, world_size: int, group) -> None:
        self.batch, self.rank, self.group = batch, rank, group
        device = batch.tokens.device
        every_rank_rows = []
        for r in range(world_size):
            rows = [offset + i for c, offset in zip(chunks, batch.offsets)
                    for lo, hi in zigzag_pieces(len(c.tokens), world_size, r) for i in range(lo, hi)]
            every_rank_rows.append(rows)
        self.lengths = [len(rows) for rows in every_rank_rows]
        self.every_rank_rows = every_rank_rows
        self.rows = torch.tensor(every_rank_rows[rank], dtype=torch.int64, device=device)
        # gathered[:, i] is flat row order[i]; flat = gathered[:, unpermute]
        order = torch.tensor([row for rows in every_rank_rows for row in rows], dtype=torch.int64)
        self.unpermute = torch.argsort(order).to(device)
        self.tokens = batch.tokens[:, self.rows]
        self.positions = batch.positions[:, self.rows]
        self.plan_chunks = chunks
        self.chunks, first_row = [], 0
        for c, offset in zip(chunks, batch.offsets):
            rows = _ChunkRows(c, offset, zigzag_pieces(len(c.tokens), world_size, rank), first_row, rank, batch.cache, device)
            self.chunks.append(rows)
            first_row += rows.num_rows
        self._layer = 0
        self._window_rows = None  # a window layer's kept and new rows per chunk (kv_store -> attend)

    def _gather(self, x: torch.Tensor) -> torch.Tensor:
        """(1, T_r, ...) of this rank's rows -> (1, T, ...) of every row, in the step's flat order."""
        return gather_slices(x, self.lengths, self.group)[:, self.unpermute]

    def kv_store(self, layer: int, k_new: torch.Tensor, v_new: torch.Tensor):
        """k_new (1, T_r, Hkv, D), v_new (1, T_r, Hkv, Dv) of this rank's rows: gather every row's
        (one all-gather of both), store the tokens whose blocks this rank holds. Returns ((k,), (v,),
        (None,)): the step's keys and values (1, T, Hkv, D), (1, T, Hkv, Dv), for attend (tuples, not
        tensors: no model reads them as a shard)."""
        batch = self.batch
        value_dim, D = batch.cache.value_dim, k_new.shape[-1]
        if value_dim:  # MLA: the values are a view of the keys
            k = self._gather(k_new)
            v = k[..., :value_dim]
        else:
            kv = self._gather(torch.cat((k_new, v_new), dim=-1))
            k, v = kv[..., :D], kv[..., D:]
        if batch.windows is not None and layer in batch.windows:  # a hybrid model's window layer
            self._window_rows = [batch.windows.extend(layer, c.seq_id, c.start, k[0, o : o + len(c.tokens)],
                                                      v[0, o : o + len(c.tokens)])
                                 for c, o in zip(self.plan_chunks, batch.offsets)]
            return (k,), (v,), (None,)
        self._window_rows = None
        if batch.paged_index is not None:  # a hybrid model: the arena holds the global layers only
            layer = batch.paged_index[layer]
        if batch.store_rows.numel():
            batch.cache.write(layer, batch.store_slots, k[0, batch.store_rows], v[0, batch.store_rows])
        if batch.cache.dtype != k.dtype:  # attend to the values the cache stores (kv_cache_dtype), as every other path does
            k = batch.cache.stored(k)
            v = k[..., :value_dim] if value_dim else batch.cache.stored(v)
        self._layer = layer
        return (k,), (v,), (None,)

    def attend(self, q: torch.Tensor, k, v, *, q_pos, kv_pos, window) -> torch.Tensor:
        """q (1, T_r, Hq, D) of this rank's rows -> out (1, T_r, Hq, Dv) in q.dtype: each row over
        its sequence's keys on every rank (the chunk's new keys here, the cached prefix by a ring)."""
        from treeattn.parallel import ring_attention

        (k,), (v,) = k, v
        out = q.new_empty(*q.shape[:-1], v.shape[-1])
        if self._window_rows is not None:
            return self._attend_window(q, out, window)
        for c in self.chunks:  # the same order on every rank: the prefix rings pair up
            rows = slice(c.first_row, c.first_row + c.num_rows)
            outs, lses, row = [], [], c.first_row
            for (lo, hi), qp, kp in zip(c.pieces, c.q_pos, c.kv_pos):
                keys = slice(c.offset, c.offset + hi)
                o, lse = attention(q[:, row : row + hi - lo], k[:, keys], v[:, keys], causal=True, q_pos=qp, kv_pos=kp,
                                   window=window)
                outs.append(o.float())
                lses.append(lse.float())
                row += hi - lo
            state = (torch.cat(outs, dim=1), torch.cat(lses, dim=2)) if outs else None
            if c.has_prefix:
                k_pre, v_pre = c.prefix(self.batch.cache, self._layer)
                prefix = ring_attention(q[:, rows], k_pre, v_pre, group=self.group, causal=True, q_pos=c.q_pos_all,
                                        kv_pos=c.prefix_pos, window=window, check_inputs=False)
                prefix = (prefix[0].float(), prefix[1].float())
                state = prefix if state is None else merge_states(*state, *prefix)
            if state is not None:
                out[:, rows] = state[0].to(out.dtype)
        return out

    def _attend_window(self, q: torch.Tensor, out: torch.Tensor, window: int | None) -> torch.Tensor:
        """A window layer: this rank's rows of each chunk over the chunk's kept and new rows (kv_store)."""
        for c, (k_w, v_w, pos_w) in zip(self.chunks, self._window_rows):
            if c.num_rows:
                rows = slice(c.first_row, c.first_row + c.num_rows)
                o, _ = attention(q[:, rows], k_w[None], v_w[None], causal=True, q_pos=c.q_pos_all, kv_pos=pos_w[None],
                                 window=window)
                out[:, rows] = o.to(out.dtype)
        return out

    def forward(self, model, rows: list[int]) -> torch.Tensor:
        """Run this rank's rows through `model`; return the final hidden states of the flat `rows`
        (indices into the step's T tokens, any order), (len(rows), hidden_size) in the model dtype,
        on every rank."""
        # (T_r, hidden): kept for prompt logprobs
        hidden = self.hidden = model(self.tokens, self.positions, self.kv_store, self.attend)[0]
        where = {row: (r, i) for r, rank_rows in enumerate(self.every_rank_rows) for i, row in enumerate(rank_rows)}
        return gather_rows(hidden, [where[row] for row in rows], self.rank, len(self.lengths), self.group)
