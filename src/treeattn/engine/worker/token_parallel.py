"""Token-parallel steps: a step's tokens split across the ranks, attention as tree attention.

A replicated step (treeattn.engine.worker.batch.PagedBatch) runs all T tokens of the step, the flat row
(1, T), through the whole model on every rank; only attention is split (each rank attends to its
shard of the cache, and the states are combined). For a prompt chunk that wastes p - 1 copies of
the embeddings, projections, MLP and norms. A token-parallel step cuts the row into p near-equal
contiguous slices (row_bounds) and rank r runs only its slice through the model. The model is
unchanged and knows nothing of ranks: it calls the injected kv_store and attend with its own rows,
and these two do the distribution, per layer:

    kv_store(layer, k_r, v_r)   k_r, v_r: (1, T_r, Hkv, D) this slice's new keys/values.
        All-gather the slices -> k, v (1, T, Hkv, D) on every rank; the PagedBatch writes the
        tokens whose blocks this rank holds (exactly as in a replicated step) and returns this
        rank's shards.
    attend(q_r, k, v, ...)      q_r: (1, T_r, Hq, D) this slice's queries (RoPE applied).
        All-gather the slices -> q (1, T, Hq, D), the same on every rank; the PagedBatch's
        attention of all T queries over this rank's shard, combined across the ranks (the
        back end's tree_decode / ring_decode, or run-by-run reads and combine_states): every rank
        then holds the exact output of all T rows and returns its own, (1, T_r, Hq, Dv).

This is tree attention (papers/tree-attention.txt) applied to a prefill chunk: Sq = T queries, the
same partial states and the same exact combine (treeattn.parallel.tree_decode.combine_states:
-inf-safe, identical on every rank) as a decode step, after one all-gather of the queries. The
attention's work per rank is T x (this rank's keys), as in a replicated step; everything else is
T / p rows. Communication per layer: two all-gathers, of (p - 1) * T_r * (Hq * D + 2 * Hkv * D)
elements sent per rank (Hkv * D for MLA's latent cache, whose values are a view of its keys), and
the combine of T rows (tree_decode's, B * Sq = T).

At the end the final hidden states of the rows that sample are spread over the ranks; one
all-gather of those rows (at most a few per sequence) brings them to every rank, and rank 0
computes the logits.

A step of few tokens (decoding: one token, and its drafts, per sequence) is not split: its cost is
streaming the weights, which a split does not reduce, and it would add two collectives per layer
to the one combine. `splits` decides: a step is split when it has at least SPLIT_MIN_TOKENS_PER_RANK
tokens per rank (measured: docs/benchmarks.md, "Token-parallel prefill in the engine").
"""

from __future__ import annotations

from bisect import bisect_right

import torch

from treeattn.parallel import comm

SPLIT_MIN_TOKENS_PER_RANK = 64
"""A step of T tokens on p ranks is token-parallel when T >= SPLIT_MIN_TOKENS_PER_RANK * p (and
p > 1). Below, each rank runs every token (a replicated step)."""


def splits(num_tokens: int, world_size: int) -> bool:
    """Whether a step of `num_tokens` tokens on `world_size` ranks runs token-parallel."""
    return world_size > 1 and num_tokens >= max(1, SPLIT_MIN_TOKENS_PER_RANK) * world_size


def row_bounds(num_tokens: int, world_size: int) -> list[int]:
    """The p + 1 bounds of the near-equal contiguous slices of a row of `num_tokens` tokens: rank r
    runs rows [bounds[r], bounds[r + 1]) (slices differ by at most one token; the first are shorter)."""
    return [r * num_tokens // world_size for r in range(world_size + 1)]


def gather_rows(hidden: torch.Tensor, owners: list[tuple[int, int]], rank: int, world_size: int, group) -> torch.Tensor:
    """Rows of a step that each live on one rank, on every rank (the sampled rows' final states).

    Args:
        hidden: (T_r, hidden_size) the states of this rank's rows.
        owners: per wanted row, (the rank that ran it, its index in that rank's rows); the same
            list on every rank.
        rank, world_size: this rank in `group`, and the group's size.
        group: the process group (or SharedMemoryGroup) of the ranks.

    Returns:
        (len(owners), hidden_size) in hidden's dtype, the wanted rows in order, on every rank.
    """
    out = hidden.new_empty(len(owners), hidden.shape[-1])
    if not owners:
        return out
    owned = [[i for i, (r, _) in enumerate(owners) if r == k] for k in range(world_size)]
    local = hidden[torch.tensor([owners[i][1] for i in owned[rank]], dtype=torch.int64, device=hidden.device)]
    gathered = gather_slices(local[None], [len(o) for o in owned], group)[0]  # rank 0's rows, rank 1's, ...
    out[torch.tensor([i for o in owned for i in o], dtype=torch.int64, device=out.device)] = gathered
    return out


def gather_slices(x: torch.Tensor, lengths: list[int], group) -> torch.Tensor:
    """Concatenate every rank's slice along dim 1.

    Args:
        x: (1, lengths[rank], ...) this rank's slice, any dtype.
        lengths: every rank's slice length, in group rank order (the same list on every rank).
        group: the process group (or SharedMemoryGroup) of the ranks.

    Returns:
        (1, sum(lengths), ...) of x's dtype: rank 0's slice, then rank 1's, ..., on every rank.
    """
    width = max(lengths)
    padded = x.new_zeros(x.shape[0], width, *x.shape[2:])  # all_gather takes equal shapes
    padded[:, : x.shape[1]] = x
    pieces = comm.all_gather(padded, group)
    return torch.cat([piece[:, :n] for piece, n in zip(pieces, lengths)], dim=1)


class TokenParallelStep:
    """One step of a PagedBatch run token-parallel: this rank's slice of its rows, the kv_store and
    attend that distribute the model's layers (see the module docstring).

    Args:
        batch: the step's PagedBatch (treeattn.engine.worker.batch): all T tokens, their positions, the
            cache writes and attention groups of this rank.
        rank, world_size: this rank in the group, and its size p.
        group: the process group (or SharedMemoryGroup) of the collectives.

    Attributes:
        bounds: row_bounds(T, p); this rank runs rows [lo, hi) = [bounds[rank], bounds[rank + 1]).
        tokens, positions: int64 (1, hi - lo), this rank's slice of batch.tokens / batch.positions.
    """

    def __init__(self, batch, rank: int, world_size: int, group) -> None:
        self.batch, self.rank, self.group = batch, rank, group
        self.bounds = row_bounds(batch.tokens.shape[1], world_size)
        self.lo, self.hi = self.bounds[rank], self.bounds[rank + 1]
        self.lengths = [b - a for a, b in zip(self.bounds, self.bounds[1:])]
        self.tokens = batch.tokens[:, self.lo : self.hi]
        self.positions = batch.positions[:, self.lo : self.hi]

    def kv_store(self, layer: int, k_new: torch.Tensor, v_new: torch.Tensor):
        """k_new (1, T_r, Hkv, D), v_new (1, T_r, Hkv, Dv) of this slice: gather all T rows, then
        batch.kv_store (stores this rank's tokens, returns its shards: see PagedBatch.kv_store)."""
        k = gather_slices(k_new, self.lengths, self.group)
        value_dim = self.batch.cache.value_dim
        v = k[..., :value_dim] if value_dim else gather_slices(v_new, self.lengths, self.group)
        return self.batch.kv_store(layer, k, v)

    def attend(self, q: torch.Tensor, k, v, *, q_pos, kv_pos, window) -> torch.Tensor:
        """q (1, T_r, Hq, D) of this slice -> out (1, T_r, Hq, Dv) in q.dtype: all T queries over
        every rank's keys (batch.attend, which combines across the ranks), this slice's rows."""
        out = self.batch.attend(gather_slices(q, self.lengths, self.group), k, v, q_pos=None, kv_pos=kv_pos, window=window)
        return out[:, self.lo : self.hi]

    def forward(self, model, rows: list[int]) -> torch.Tensor:
        """Run this rank's slice through `model`; return the final hidden states of the flat `rows`
        (indices into the step's T tokens, any order), (len(rows), hidden_size) in the model dtype,
        on every rank."""
        # (T_r, hidden): kept for prompt logprobs
        hidden = self.hidden = model(self.tokens, self.positions, self.kv_store, self.attend)[0]
        owner = [bisect_right(self.bounds, row) - 1 for row in rows]  # the slice that holds each row
        owners = [(r, row - self.bounds[r]) for r, row in zip(owner, rows)]
        return gather_rows(hidden, owners, self.rank, len(self.lengths), self.group)
