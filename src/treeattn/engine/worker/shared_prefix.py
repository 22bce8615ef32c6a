"""Shared-prefix (cascade) decode attention: blocks that several decoding sequences share are read
once per step for all of them.

When many requests question one long document, the prefix cache (treeattn.cache.prefix) gives
them the same physical blocks for it, and a decode step has n sequences whose block tables begin
with the same BlockRefs. Read sequence by sequence, those blocks are read n times a layer. Here
they are read once: the queries of the n sequences are stacked as rows of one batch row
(1, R, Hq, D), R the n sequences' query rows (1 each, 1 + d with d drafts), and attend to the
shared keys in one call -- bifurcated attention (papers/bifurcated-attention.txt, and
treeattn.ops.bifurcated's fold_samples) with the context found in the block tables instead of
given. Each sequence then attends to the rest of its blocks, the two states merge exactly
(merge_states), and one combine across the ranks (tree_decode's combine_states) finishes the
step, as for a run-by-run read (treeattn.engine.worker.runner).

Segments. The decoding sequences' block tables form a trie (a path of BlockRefs per sequence,
over its full blocks before its first query, keys every one of its queries sees). find_segments
walks it: a stretch of K keys (all ranks together) that m >= 2 sequences share is a segment, read
once for its m sequences, when it saves (m - 1) x K >= SHARE_MIN_SAVED_KEYS key reads; a shorter
shared stretch is not worth an extra attention call and passes down to the next segment below it (or to the
sequences' own part). So each sequence's blocks are, in order: the segments on its path, which
cover logical blocks [0, own_from) with no gap, then its own part [own_from, end), read as
before (gathered into one batched call, or run by run). Sequences sharing different prefixes in
one step (two documents, or a document and a longer shared instruction) get a segment each;
nested sharing gets nested segments (the cascade of FlashInfer's multi-level cascade attention).

Exactness. Every key of a sequence is in exactly one of its segments or its own part; the states
merge with merge_states (associative: the order only changes float32 rounding). A segment's keys
all lie before every query of its sequences (full blocks before the first query position), so
the segment's call needs no mask.

Where it applies: the decoding chunks of a step, when the rank's attention can be split into
local states and one combine (tree or local decoding, no sliding window: PagedBatch's `combine`).
Ring decoding (decode="ring", p > 1) passes every sequence's K/V shard around the ring itself and
is left as it is; sliding-window models too (a window hides different shared keys from different
sequences). Prefill chunks are not affected.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch

from treeattn.cache.blocks import BlockRef
from treeattn.ops import attention, merge_states, merge_states_list

SHARE_MIN_SAVED_KEYS = 512
"""A stretch of K keys (all ranks together) shared by m >= 2 decoding sequences is read once for
them when that saves at least this many key reads, (m - 1) x K >= SHARE_MIN_SAVED_KEYS; below, the
extra attention call and merge cost more than the reads they save. Measured for one layer of
SmolLM2's shape on this machine (benchmarks/engine/engine_shared_prefix.py --threshold, docs/benchmarks.md):
sharing lost at (m - 1) x K <= 496 for m = 4 and 16 and won from 768 (m = 4) and 960 (m = 16);
for m = 2 it already won at 256 (1.15x), the one case of the grid this threshold leaves unshared."""


@dataclass(frozen=True)
class Segment:
    """Logical blocks [lo, hi) that the decoding chunks `members` (indices into the step's
    decoding chunks) all hold as the same physical `blocks` (BlockRefs, logical block lo first)."""

    members: tuple[int, ...]
    lo: int
    hi: int
    blocks: tuple[BlockRef, ...]


def find_segments(chunks, block_size: int, min_saved: int | None = None) -> tuple[list[Segment], list[int]]:
    """The shared segments of decoding chunks (see the module docstring).

    Args:
        chunks: the step's decoding chunks (treeattn.engine.scheduler.Chunk), in order.
        block_size: tokens per block.
        min_saved: the fewest key reads a segment must save, (members - 1) x keys (None:
            SHARE_MIN_SAVED_KEYS).

    Returns:
        segments, and own_from: per chunk, the first logical block that no segment covers (0
        for a chunk in no segment); its segments cover blocks [0, own_from).
    """
    min_saved = SHARE_MIN_SAVED_KEYS if min_saved is None else min_saved
    # Each chunk's full blocks before its first query: every one of its queries sees all their keys.
    paths = [c.blocks[: c.start // block_size] for c in chunks]
    segments: list[Segment] = []
    own_from = [0] * len(chunks)

    def walk(members: list[int], depth: int, start: int) -> None:
        # members share blocks [0, depth); blocks [start, depth) are not in a segment yet
        if len(members) == 1:
            own_from[members[0]] = start
            return
        end, first = depth, paths[members[0]]
        while all(len(paths[b]) > end and paths[b][end] == first[end] for b in members):
            end += 1
        if (len(members) - 1) * (end - start) * block_size >= max(1, min_saved):
            segments.append(Segment(tuple(members), start, end, tuple(first[start:end])))
            start = end
        branches: dict[BlockRef, list[int]] = defaultdict(list)
        for b in members:
            if len(paths[b]) > end:
                branches[paths[b][end]].append(b)
            else:
                own_from[b] = start
        for sub in branches.values():
            walk(sub, end, start)

    if chunks:
        walk(list(range(len(chunks))), 0, 0)
    return segments, own_from


def saved_keys(segments: list[Segment], block_size: int) -> int:
    """Key reads per layer that reading `segments` once saves: (members - 1) x keys, summed."""
    return sum((len(s.members) - 1) * (s.hi - s.lo) * block_size for s in segments)


class SharedSegments:
    """This rank's reads of a step's segments: which query rows, which local blocks.

    Args:
        segments: from find_segments over the decoding chunks.
        chunks, offsets: the decoding chunks and the flat row of each one's first token in the step.
        width: S, the query rows per sequence of the decoding group (the most tokens of a chunk).
        rank: this rank; only its blocks of each segment are read here.
        block_size: tokens per block. device: of the cache.
        copy_free_min_keys: read a segment's local blocks as views of the arena when its runs of
            adjacent blocks average at least this many keys; gather them otherwise.
    """

    def __init__(self, segments: list[Segment], chunks, offsets: list[int], width: int, rank: int, block_size: int, device,
                 copy_free_min_keys: int) -> None:
        # per segment with blocks on this rank: (flat query rows, their rows in the group's (B * S)
        # grid, runs [(first block id, blocks)] read as views, or None and `table` to gather)
        self.reads = []
        for s in segments:
            local = [ref.index for ref in s.blocks if ref.rank == rank]
            if not local:
                continue
            rows = [offsets[b] + i for b in s.members for i in range(len(chunks[b].tokens))]
            grid = [b * width + i for b in s.members for i in range(len(chunks[b].tokens))]
            runs, table = _runs(local), None
            if len(runs) > 1 and len(local) * block_size < copy_free_min_keys * len(runs):  # short runs: one copy
                runs, table = None, torch.tensor([local], dtype=torch.int64, device=device)
            self.reads.append((torch.tensor(rows, dtype=torch.int64, device=device),
                               torch.tensor(grid, dtype=torch.int64, device=device), runs, table))

    def merge_into(self, out: torch.Tensor, lse: torch.Tensor, flat_q: torch.Tensor, cache,
                   layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Merge this rank's segment states into the decoding group's own-part state.

        Args:
            out: (B, S, Hq, Dv), lse: (B, Hq, S), float32 (float64 for float64 q): the group's state over each
                sequence's own part on this rank (padding rows: anything; they are dropped later).
                Both are overwritten.
            flat_q: (T, Hq, D) the step's queries (RoPE applied), rows in step order.
            cache: this rank's PagedKVCache; layer: the layer being run.

        Returns:
            (out, lse) of the same shapes and dtype: with every segment's keys on this rank merged in.
        """
        if not self.reads:
            return out, lse
        B, S, Hq, Dv = out.shape
        out_rows = out.reshape(B * S, Hq, Dv)  # written in place: out and lse are the caller's to give up
        lse_rows = lse.transpose(1, 2).reshape(B * S, Hq)
        for rows, grid, runs, table in self.reads:
            q = flat_q[rows][None]  # (1, R, Hq, D): the members' query rows stacked
            if runs is None:
                states = [attention(q, *cache.gather(layer, table))]  # every query sees every key of a segment: no mask
            else:
                states = [attention(q, *(x[None] for x in cache.run(layer, a, n))) for a, n in runs]
            o, s = merge_states_list([o for o, _ in states], [s for _, s in states]) if len(states) > 1 else states[0]
            merged, merged_lse = merge_states(out_rows[grid][None], lse_rows[grid].T[None], o.to(out.dtype), s.to(out.dtype))
            out_rows[grid] = merged[0]
            lse_rows[grid] = merged_lse[0].T
        return out_rows.view(B, S, Hq, Dv), lse_rows.view(B, S, Hq).transpose(1, 2).contiguous()


def _runs(blocks: list[int]) -> list[tuple[int, int]]:
    """Maximal runs of adjacent block ids, in order, as (first id, number of blocks)."""
    runs: list[tuple[int, int]] = []
    for block in blocks:
        if runs and runs[-1][0] + runs[-1][1] == block:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((block, 1))
    return runs
