"""Prompt log-probabilities: log p(prompt[i] | prompt[:i]) of a prompt's tokens, computed in its prefill.

    rows = PromptRows.of(plan.chunks, offsets)          # the step's rows that score a prompt token (None: none)
    packed = rows.compute(model, owned, hidden, rank, group)   # on every rank; rank 0 gets the result
    rows.unpack(packed)                                 # seq_id -> (first position scored, [TokenLogprob, ...])

A request with SamplingParams.prompt_logprobs = k asks, for every prompt token but the first, its
log-probability under the model and the k most likely tokens at its position (vLLM's
prompt_logprobs; OpenAI's `echo` with `logprobs`). The row of prompt position i (its final hidden
state) predicts token i + 1, so a prefill chunk at positions start .. start + n - 1 scores the prompt
tokens start + 1 .. start + n (those inside the prompt): the scheduler puts them in Chunk.targets.

The work is the output projection of every such row over the whole vocabulary, which for a long
prompt is a prompt x vocabulary matrix (8K x 262,144 float32 for Gemma 3: 8 GiB). It is never
materialized: the rows are taken ROWS_PER_BLOCK at a time, and each block's logits a chunk of the
vocabulary at a time (vocab_columns: 4 MiB of logits a thread on the CPU; with torch on 2+ threads the chunks are
split between the threads of chunk_pool, one torch thread each), each chunk reduced while it is in
the cache: its logsumexp (merged across chunks like attention states), the count of logits above the
target's, its top k (on the CPU one compiled pass a row, ops.logits_cpu_kernel, where numba is installed;
torch's calls elsewhere). Kept per row: the log-softmax at the target (float32 logit - logsumexp, as the
generated tokens' logprobs, runner.token_logprobs), the target's rank and the top k: 2 + 2k numbers.
A GGUF file's packed output projection is dequantized once and kept for the next steps, not once per block as
the packed layer's own product of many rows would: where ops.dense_linear takes oneDNN's matmul (AMD and other
non-Intel CPUs: ~1.2x MKL's sgemm on this project's AMD EPYC) as runs of vocab_columns rows each held in oneDNN's
blocked layout (prepacked_head: no reorder of the weight a call), else as one plain float32 copy (dense_head) that
MKL's sgemm multiplies (Intel CPUs, where MKL is the faster one; a GPU).

Across ranks the rows are split, not the vocabulary: in a token-parallel or ring prefill step each
rank already holds the final hidden states of its own rows, so it scores those (no hidden state
moves); in a replicated step (every rank ran every row) rank r scores the r-th of p near-equal
slices of the wanted rows. Each row's log-softmax is then computed whole on one rank (the same
values as one rank computing it: each logit is its own dot product, and the logsumexp is over the
same logits), and one all-gather of the packed results (rows x (2 + 2k) float64) brings them to
rank 0. Splitting the vocabulary instead would first need every rank to hold every row's hidden
state (an all-gather of rows x hidden_size) and then a combine of per-share logsumexps: more bytes
for the same arithmetic.
"""

from __future__ import annotations

import math
import os
import threading
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from treeattn.engine.request import TokenLogprob
from treeattn.ops import dense_linear
from treeattn.ops.kernels import optional_kernel
from treeattn.engine.worker.token_parallel import gather_slices, row_bounds

ROWS_PER_BLOCK = 512
"""Prompt rows scored together: their hidden states are multiplied by the LM head a chunk of the
vocabulary at a time (vocab_columns; 512 rows reuse each chunk of the head more than 256: about 4 %
less CPU time for SmolLM2's head, one thread, under load), and on a GPU by the whole head at once
(ROWS_PER_BLOCK x vocab_size float32 logits: Gemma 3 512 MiB, SmolLM2 96 MiB)."""

CHUNK_BYTES = 4 << 20
"""On the CPU, the float32 logits computed at once per torch thread: a block's rows x vocab_columns(rows, V)
columns (4 MiB a thread; SmolLM2, 512 rows: 2048 columns; with torch on 2+ threads each thread of chunk_pool
takes its own run of 2048-column chunks, on one torch thread). The reductions (max,
exp-sum, count of larger logits, top k) read each chunk right after the product wrote it, from the cache
(ops.logits_cpu_kernel: a row at a time, from L1 after its first read);
no prompt x vocabulary or even block x vocabulary matrix is made. Smaller chunks mean more calls, each a
parallel region whose threads wait for one another (on 2 threads, 1 MiB chunks cost more CPU than one
whole block, which chunk_pool avoids); larger ones fall out of the cache (16 MiB on 1 thread cost more than 8):
benchmarks/engine/prompt_logprobs_parts.py, docs/engine.md#prompt-log-probabilities. On a GPU one chunk is
the whole vocabulary (one launch a reduction)."""


_LOG2_E = math.log2(math.e)
"""exp(x) = exp2(x * _LOG2_E): torch's float32 exp2 is a third of exp's CPU time (AVX-512, one thread: 0.0076 vs 0.0217 s
for 24 x 512 x 2048 values, under load), and its sums of a chunk's exp(logit - max) have exp's error (both within
3e-7 of float64 for logits of scale 0.3-30). The product by _LOG2_E rounds x once more, 2**-24 |x| relatively:
large only for the terms far below the max, whose weight in the sum is exp(x), at most ~log(columns) * 2**-24 of it."""


def vocab_columns(rows: int, vocab_size: int, device: torch.device | str = "cpu", threads: int | None = None) -> int:
    """The vocabulary columns of one chunk of `rows` rows' logits: CHUNK_BYTES of float32 for each of
    `threads` (default: torch's intra-op threads) on the CPU, at least 1, at most vocab_size; the whole
    vocabulary on another device.

    >>> from treeattn.engine.worker.prompt_logprobs import vocab_columns
    >>> vocab_columns(512, 49152, threads=1), vocab_columns(512, 49152, threads=2), vocab_columns(256, 300)
    (2048, 4096, 300)
    >>> vocab_columns(10**7, 50, threads=1), vocab_columns(512, 49152, "cuda")
    (1, 49152)
    """
    if torch.device(device).type != "cpu":
        return vocab_size
    threads = torch.get_num_threads() if threads is None else threads
    return max(1, min(vocab_size, threads * CHUNK_BYTES // (4 * rows)))


@dataclass(frozen=True)
class PromptRows:
    """The rows of one step that score a prompt token.

    Attributes:
        rows: the flat step rows (indices into the step's T tokens), in chunk order.
        targets: the prompt token each row scores (the token at the row's position + 1).
        top: the most alternatives any of the step's requests asks for.
        spans: per chunk with targets, (seq_id, k, first position scored, number of rows).
    """

    rows: tuple[int, ...]
    targets: tuple[int, ...]
    top: int
    spans: tuple[tuple[int, int, int, int], ...]

    @classmethod
    def of(cls, chunks, offsets: list[int]) -> "PromptRows | None":
        """The step's prompt rows from its chunks (Chunk.targets, Chunk.prompt_logprobs) and each
        chunk's first row in the step (PagedBatch.offsets); None when no chunk has any."""
        rows, targets, spans = [], [], []
        for c, offset in zip(chunks, offsets):
            if not c.targets:
                continue
            rows += range(offset, offset + len(c.targets))
            targets += c.targets
            spans.append((c.seq_id, c.prompt_logprobs, c.start + 1, len(c.targets)))
        if not rows:
            return None
        return cls(tuple(rows), tuple(targets), max(k for _, k, _, _ in spans), tuple(spans))

    def compute(self, model, owned: list[list[int]] | None, hidden: torch.Tensor, rank: int, group) -> torch.Tensor | None:
        """Score this rank's share of the rows; the packed results of all rows on rank 0.

        Args:
            model: the LlamaModel (its .logits: final hidden states -> float32 logits).
            owned: per rank, the flat step rows whose final hidden states it holds, in the order of
                its `hidden` rows (a token-parallel or ring step); None for a replicated step, whose
                `hidden` is every row's (T, hidden_size) on every rank.
            hidden: this rank's final hidden states, (len(owned[rank]), hidden_size) or (T, hidden_size).
            rank, group: this rank and the group of the step's ranks (their number: len(owned)).

        Returns:
            On rank 0, float64 (len(self.rows), 2 + 2 * top): per row its logprob, its rank, then
            the top values and the top token ids (see score_rows); None on the other ranks.
        """
        from treeattn.models.attention import group_world_size

        p = group_world_size(group)
        if owned is None:  # replicated: rank r scores slice r of the wanted rows
            bounds = row_bounds(len(self.rows), p)
            shares = [list(range(bounds[k], bounds[k + 1])) for k in range(p)]  # indices into self.rows
            mine = _take(hidden, [self.rows[i] for i in shares[rank]])
        else:
            index = {row: i for i, row in enumerate(self.rows)}
            shares = [[index[row] for row in rows if row in index] for rows in owned]
            where = {row: i for i, row in enumerate(owned[rank])}
            mine = _take(hidden, [where[self.rows[i]] for i in shares[rank]])
        targets = torch.tensor([self.targets[i] for i in shares[rank]], dtype=torch.int64)
        packed = score_rows(model, mine, targets, self.top)
        if p > 1:
            packed = gather_slices(packed[None], [len(s) for s in shares], group)[0]
        if rank != 0:
            return None
        out = torch.empty_like(packed)
        out[torch.tensor([i for s in shares for i in s], dtype=torch.int64)] = packed
        return out

    def unpack(self, packed: torch.Tensor) -> dict[int, tuple[int, list[TokenLogprob] | None]]:
        """seq_id -> (the first prompt position scored, one TokenLogprob per scored position), from
        compute's result; the list is None where a value is not finite (the request fails)."""
        out, first = {}, 0
        values = packed.tolist()
        for seq_id, k, position, n in self.spans:
            rows = values[first : first + n]
            first += n
            finite = torch.isfinite(packed[first - n : first, : 2 + k]).all().item()
            entries = [TokenLogprob(row[0], tuple((int(row[2 + self.top + j]), row[2 + j]) for j in range(k)), int(row[1]))
                       for row in rows]
            out[seq_id] = (position, entries if finite else None)
        return out




def _take(hidden: torch.Tensor, index: list[int]) -> torch.Tensor:
    """hidden[index]: a view where the rows are consecutive (a prefill chunk's: no copy), else a gathered copy.

    >>> import torch
    >>> from treeattn.engine.worker.prompt_logprobs import _take
    >>> hidden = torch.tensor([[0.0, 1.0], [2.0, 3.0], [4.0, 5.0], [6.0, 7.0]])
    >>> _take(hidden, [1, 2])._base is hidden, _take(hidden, [0, 2]).tolist()
    (True, [[0.0, 1.0], [4.0, 5.0]])
    """
    if index and index == list(range(index[0], index[0] + len(index))):
        return hidden[index[0] : index[0] + len(index)]
    return hidden[torch.tensor(index, dtype=torch.int64, device=hidden.device)]


def dense_head(model) -> torch.Tensor | None:
    """The float32 dequantization of `model`'s output projection when it is kept packed
    (treeattn.models.packed), else None (a plain weight is multiplied as it is).

    A packed layer multiplies more than MAX_KERNEL_ROWS rows by dequantizing its whole weight for
    each call (ops.packed_linear.packed_matmul): for the prompt rows, block after block, that
    dequantization cost about as much as the product itself (SmolLM2: 49,152 x 576). The copy is
    made once and kept on the head itself for the next steps, as long as the model lives (SmolLM2 113 MB,
    Gemma 3 270M 671 MB a rank; no process-wide cache), and model.logits(hidden, weight=copy)
    multiplies it in float32 as the packed layer multiplies many rows (ops.dense_linear.linear_float32: MKL's sgemm
    or oneDNN's matmul, the faster on this CPU). score_rows takes it where prepacked_head does not apply.

        >>> import torch, treeattn as ta
        >>> from treeattn.engine.worker.prompt_logprobs import dense_head
        >>> from treeattn.models import random_model
        >>> model = random_model(ta.LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=32,
        ...     num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16), seed=0)
        >>> dense_head(model) is None  # its embedding is a plain nn.Embedding
        True
    """
    head = model.embed_tokens if getattr(model, "lm_head", None) is None else model.lm_head
    if not hasattr(head, "dequantized"):
        return None
    kept = head.__dict__.get("_prompt_logprobs_copy")  # (qs, d_bits, copy): valid while the packed buffers are
    if kept is not None and kept[0] is head.qs and kept[1] is head.d_bits:
        return kept[2]
    weight = head.dequantized()
    head.__dict__["_prompt_logprobs_copy"] = (head.qs, head.d_bits, weight)  # a plain attribute: not in state_dict
    return weight


_PREPACKED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""prepacked_head's chunks, per head module (kept while the module lives; a plain attribute would be pickled with it,
and oneDNN's tensors do not pickle): (qs, d_bits, columns, chunks)."""


def prepacked_head(model) -> tuple[tuple[torch.Tensor, ...], int] | None:
    """`model`'s packed output projection in float32 by vocabulary chunks, each held in oneDNN's blocked layout:
    (chunks, columns), chunk j the head's rows j * columns .. (j + 1) * columns - 1, columns = vocab_columns of a
    ROWS_PER_BLOCK block on one thread (SmolLM2: 2048, 24 chunks). None where ops.dense_linear does not take oneDNN
    (onednn_float32(): an Intel CPU, non-strict float32 math), for a head kept on another device, or one not packed.

    Made once, a chunk at a time from the packed rows (dequantized_rows, never the whole float32 head at once), and
    kept while the head lives and its buffers are the same (as dense_head's copy, which it replaces: about the same
    bytes, SmolLM2 113 MB, not a second copy). Each call of linear_float32 on a chunk then skips oneDNN's reorder
    of the weight (5-9 % faster products on the AMD EPYC, session 19), with the plain weight's bits.

        >>> import torch, treeattn as ta
        >>> from treeattn.engine.worker.prompt_logprobs import prepacked_head
        >>> from treeattn.models import random_model
        >>> model = random_model(ta.LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=32,
        ...     num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16), seed=0)
        >>> prepacked_head(model) is None  # its head is a plain float32 weight: multiplied as it is
        True
    """
    head = model.embed_tokens if getattr(model, "lm_head", None) is None else model.lm_head
    if not hasattr(head, "dequantized_rows") or head.qs.device.type != "cpu" or not dense_linear.onednn_float32():
        return None
    columns = vocab_columns(ROWS_PER_BLOCK, head.rows, threads=1)
    kept = _PREPACKED.get(head)
    if kept is not None and kept[0] is head.qs and kept[1] is head.d_bits and kept[2] == columns:
        return kept[3], columns
    chunks = tuple(dense_linear.prepack_float32(head.dequantized_rows(slice(first, first + columns)), ROWS_PER_BLOCK)
                   for first in range(0, head.rows, columns))
    head.__dict__.pop("_prompt_logprobs_copy", None)  # a plain copy made before (the rule changed): replaced
    _PREPACKED[head] = (head.qs, head.d_bits, columns, chunks)
    return chunks, columns


@dataclass(frozen=True)
class _Head:
    """The LM head as _score_block multiplies it.

    Attributes:
        vocab: its rows (the vocabulary size); None for a head of another kind (model.logits(vocab) multiplies it).
        weight: the plain head whose rows are the targets' (a packed head's float32 copy, the model's own weight);
            None where prepacked (then `packed` gives the targets' rows) or of another kind.
        dense: whether model.logits(weight=weight) multiplies it (a float32 weight: ops.dense_linear's product).
        chunks, columns: prepacked_head's, or () and None.
        packed: the packed head module (its dequantized_rows) where prepacked, else None.
    """

    vocab: int | None
    weight: torch.Tensor | None
    dense: bool
    chunks: tuple = ()
    columns: int | None = None
    packed: object = None

    @classmethod
    def of(cls, model) -> "_Head":
        """The head of `model` as score_rows multiplies it: prepacked where prepacked_head applies, else its plain
        float32 copy (dense_head), else its own weight."""
        head = model.embed_tokens if getattr(model, "lm_head", None) is None else model.lm_head
        prepacked = prepacked_head(model)
        if prepacked is not None:
            return cls(head.rows, None, True, prepacked[0], prepacked[1], head)
        copy = dense_head(model)
        weight = copy if copy is not None else getattr(head, "weight", None)  # None: a head of another kind
        return cls(None if weight is None else weight.shape[0], weight, weight is not None and weight.dtype == torch.float32)

    def target_rows(self, targets: torch.Tensor) -> torch.Tensor:
        """The head's rows `targets` (the values the chunks hold)."""
        return self.weight[targets] if self.packed is None else self.packed.dequantized_rows(targets)

    def logits(self, model, hidden: torch.Tensor, j: int, vocab: slice | None) -> torch.Tensor:
        """The float32 logits of chunk j, the columns `vocab` (None: every column)."""
        if self.chunks:
            return model.logits(hidden, weight=self.chunks[j])
        return model.logits(hidden, vocab, **({"weight": self.weight} if self.dense else {}))


def score_rows(model, hidden: torch.Tensor, targets: torch.Tensor, top: int) -> torch.Tensor:
    """Each row's log-softmax at its target token and its `top` most likely tokens, ROWS_PER_BLOCK
    rows at a time, their logits a vocabulary chunk at a time (vocab_columns; never more logits at once).

    Args:
        model: has .logits(hidden, vocab=None, weight=None) -> float32 (rows, V) (the columns of `vocab`).
        hidden: (n, hidden_size) final hidden states.
        targets: int64 (n,) the token each row scores.
        top: alternatives per row (0: none; nothing of the top k is computed then).

    Returns:
        float64 (n, 2 + 2 * top): logprob of the target (its float32 logit - the logsumexp of the float32
        logits), its rank (1 + the tokens with a larger logit, vLLM's), the top log-probabilities (most
        likely first), the top token ids.

    Example (a tiny random model; the values equal torch.log_softmax of the whole logits)::

        >>> import torch, treeattn as ta
        >>> from treeattn.engine.worker.prompt_logprobs import score_rows
        >>> from treeattn.models import random_model
        >>> model = random_model(ta.LlamaConfig(vocab_size=50, hidden_size=16, intermediate_size=32,
        ...     num_layers=1, num_heads=2, num_kv_heads=1, head_dim=8), seed=0)
        >>> hidden, targets = torch.randn(3, 16), torch.tensor([4, 9, 49])
        >>> packed = score_rows(model, hidden, targets, top=2)
        >>> expected = torch.log_softmax(model.logits(hidden), dim=-1)
        >>> torch.allclose(packed[:, 0], expected[torch.arange(3), targets].double())
        True
        >>> torch.equal(packed[:, 4:].long(), expected.topk(2).indices)
        True
    """
    out = torch.empty(hidden.shape[0], 2 + 2 * top, dtype=torch.float64, device=hidden.device)
    targets = targets.to(hidden.device)
    # a packed head prepacked by chunks or its float32 copy (made once), or a plain float32 head: ops.dense_linear's product
    head = _Head.of(model)
    with torch.no_grad():  # the reductions write into `out=` tensors
        for lo in range(0, hidden.shape[0], ROWS_PER_BLOCK):
            rows = slice(lo, lo + ROWS_PER_BLOCK)
            _score_block(model, hidden[rows], targets[rows], top, out[rows], head)
    return out


def _score_block(model, hidden: torch.Tensor, targets: torch.Tensor, top: int, out: torch.Tensor, head: _Head) -> None:
    """score_rows' values for a block of rows, written into `out`: one pass over the vocabulary, a chunk
    of logits (vocab_columns; a prepacked head's own chunks, those of a ROWS_PER_BLOCK block, for a shorter one
    too) at a time, each reduced while it is in the cache: its max, its sum of
    exp(logit - max) (as exp2) and its count of logits above the target's, one row each of a
    (chunks, rows) table, the top k merged (_ChunkReducer: on the CPU ops.logits_cpu_kernel.reduce_chunk, one
    compiled pass a row, 0.26x the CPU of torch's calls for SmolLM2's 512 x 2048 chunks, one thread, under load:
    docs/engine.md, "Session 23"; else torch's calls, _LOG2_E); then the chunks' sums are merged in float64 (logsumexp = max +
    log(sum)). The count needs the target's logit before its chunk comes: with more than one chunk it is computed first (the
    block's rows against the targets' rows of `weight`); where that product rounds the target's own logit
    below its chunk's, the count drops it. The counts are float32 (exact: a chunk has far fewer than 2**24
    columns), whose compare-and-sum is one vectorized pass where a bool mask's sum was a conversion and a
    reduction (per 512-row block of SmolLM2 on one thread: 0.014 s instead of 0.039, under load).

    With torch on more than one thread (CPU), the chunks are split into that many contiguous runs, each
    reduced by one thread of chunk_pool (one torch thread each): no parallel region, so no thread waits for
    another between the chunk's ~8 calls (see chunk_pool)."""
    n, device = hidden.shape[0], hidden.device
    threads = 1 if head.vocab is None or device.type != "cpu" else torch.get_num_threads()
    columns = head.columns or (None if head.vocab is None else
                               vocab_columns(n, head.vocab, device, threads=1 if threads > 1 else None))
    starts = [0] if columns is None or columns >= head.vocab else list(range(0, head.vocab, columns))
    chosen = None if len(starts) == 1 else model.logits(hidden, weight=head.target_rows(targets)).diagonal().contiguous()
    picked = torch.empty(n, dtype=torch.float32, device=device)  # the target's logit, from its chunk
    table = torch.empty(3, len(starts), n, dtype=torch.float32, device=device)  # per chunk: max, sum of exp, count
    rows_in = {}  # chunk -> the rows whose target it holds
    for row, j in enumerate((targets // columns).tolist() if len(starts) > 1 else [0] * n):
        rows_in.setdefault(j, []).append(row)
    rows_in = {j: (torch.tensor(r, device=device), targets[r] - starts[j]) for j, r in rows_in.items()}  # (rows, columns)
    reduce = _ChunkReducer(model, hidden, top, head, starts, columns, rows_in, picked, chosen, table)
    bounds = row_bounds(len(starts), min(threads, len(starts)))  # contiguous runs of chunks, one a pool thread
    runs = [range(lo, hi) for lo, hi in zip(bounds, bounds[1:])]
    parts = [reduce(runs[0])] if len(runs) == 1 else list(chunk_pool(threads).map(reduce, runs))
    values, ids = parts[0]
    for more_values, more_ids in parts[1:]:  # the runs' top k, merged in chunk order
        merged = torch.cat([values, more_values], dim=1)
        values, where = torch.topk(merged, min(top, merged.shape[1]), dim=-1)
        ids = torch.cat([ids, more_ids], dim=1).gather(1, where)
    maxes, sums, larger = table
    count = larger.double().sum(dim=0) if chosen is None else larger.double().sum(dim=0) - (picked > chosen).double()
    top_max = maxes.double().amax(dim=0)
    lse = top_max + torch.log((sums.double() * torch.exp(maxes.double() - top_max)).sum(dim=0))
    out[:, 0] = picked.double() - lse
    out[:, 1] = count + 1
    if top:
        out[:, 2 : 2 + top] = values.double() - lse[:, None]
        out[:, 2 + top :] = ids


@dataclass
class _ChunkReducer:
    """Reduces a run of a block's vocabulary chunks (called with their indices, in order) into `table`
    (max, sum of exp2, count of larger logits per chunk) and `picked` (the targets' logits); returns the
    run's top k (values, ids). Runs of different chunks write different rows of both: they may run at once."""

    model: object
    hidden: torch.Tensor
    top: int
    head: _Head
    starts: list[int]
    columns: int | None
    rows_in: dict
    picked: torch.Tensor
    chosen: torch.Tensor | None
    table: torch.Tensor

    def __call__(self, run: range) -> tuple[torch.Tensor, torch.Tensor]:
        kernel = reduction_kernel(self.hidden.device)
        with torch.inference_mode():  # a pool thread's own mode (thread-local); the writes go into `table`
            return self._torch(run) if kernel is None else self._compiled(run, kernel)

    def _chunk(self, j: int) -> torch.Tensor:
        """Chunk j's float32 logits (rows, columns); the targets it holds copied into `picked`."""
        vocab = None if len(self.starts) == 1 else slice(self.starts[j], self.starts[j] + self.columns)
        logits = self.head.logits(self.model, self.hidden, j, vocab)
        if j in self.rows_in:
            self.picked[self.rows_in[j][0]] = logits[self.rows_in[j]]
        return logits

    def _compiled(self, run: range, kernel) -> tuple[torch.Tensor, torch.Tensor]:
        """The run's reductions by ops.logits_cpu_kernel.reduce_chunk: one pass a row of each chunk."""
        n, top = self.hidden.shape[0], self.top
        maxes, sums, larger = self.table
        values = torch.full((n, top), -math.inf, dtype=torch.float32)
        ids = torch.zeros(n, top, dtype=torch.int64)
        arrays = values.numpy(), ids.numpy()
        for j in run:
            logits = self._chunk(j).contiguous()
            target = self.picked if self.chosen is None else self.chosen
            kernel.reduce_chunk(logits.numpy(), target.numpy(), self.starts[j], maxes[j].numpy(), sums[j].numpy(),
                                larger[j].numpy(), *arrays)
        return values, ids

    def _torch(self, run: range) -> tuple[torch.Tensor, torch.Tensor]:
        """The run's reductions by torch calls: max, count, exp-sum and top k, each a pass over the chunk."""
        n, device, top = self.hidden.shape[0], self.hidden.device, self.top
        maxes, sums, larger = self.table
        values, ids = torch.empty(n, 0, device=device), torch.empty(n, 0, dtype=torch.int64, device=device)
        scratch = None  # the chunk's comparisons, then its exp(logit - max): one buffer for every chunk of its shape
        for j in run:
            logits = self._chunk(j)
            if scratch is None or scratch.shape != logits.shape:
                scratch = torch.empty_like(logits)
            torch.amax(logits, dim=-1, out=maxes[j])
            target = (self.picked if self.chosen is None else self.chosen)[:, None]
            torch.sum(torch.gt(logits, target, out=scratch), dim=-1, out=larger[j])
            torch.sum(torch.sub(logits, maxes[j][:, None], out=scratch).mul_(_LOG2_E).exp2_(), dim=-1, out=sums[j])
            if top:
                chunk_values, chunk_ids = torch.topk(logits, min(top, logits.shape[1]), dim=-1)
                merged = torch.cat([values, chunk_values], dim=1)
                values, where = torch.topk(merged, min(top, merged.shape[1]), dim=-1)
                ids = torch.cat([ids, chunk_ids + self.starts[j]], dim=1).gather(1, where)
        return values, ids


def reduction_kernel(device: torch.device):
    """ops.logits_cpu_kernel (one compiled pass a row of a chunk of logits) for logits on the CPU where numba is
    installed, else None (_ChunkReducer's torch calls).

    >>> import torch
    >>> from treeattn.engine.worker.prompt_logprobs import reduction_kernel
    >>> reduction_kernel(torch.device("meta")) is None
    True
    """
    return optional_kernel("logits_cpu_kernel") if device.type == "cpu" else None


_POOL: list = []  # [(threads, pid, ThreadPoolExecutor)]: chunk_pool's one pool (a forked child's copy has no threads)


def chunk_pool(threads: int) -> ThreadPoolExecutor:
    """A pool of `threads` threads, each running torch on ONE intra-op thread, made once (per `threads`).

    On the CPU a chunk's product and reductions are ~8 torch calls; run by torch's own 2 threads, each call
    is a parallel region whose threads wait for each other at its end (spinning, as OpenMP does), and on a
    busy machine one waits for the other to get a core. Two pool threads each reducing their own half of
    the chunks (one torch thread each: torch's thread count is per thread with OpenMP) never wait for each
    other until the block's end. torch.set_num_threads(1) also sets the count a new thread starts with,
    so the caller's count is set back once the pool's threads have taken theirs.

        >>> import torch
        >>> from treeattn.engine.worker.prompt_logprobs import chunk_pool
        >>> threads = torch.get_num_threads()
        >>> list(chunk_pool(2).map(lambda _: torch.get_num_threads(), range(2))), torch.get_num_threads() == threads
        ([1, 1], True)
    """
    if _POOL and _POOL[0][:2] == (threads, os.getpid()):
        return _POOL[0][2]
    if _POOL:
        _, pid, old = _POOL.pop()
        if pid == os.getpid():
            old.shutdown(wait=False)
    caller = torch.get_num_threads()
    ready = threading.Barrier(threads)

    def one_thread(_) -> int:
        torch.set_num_threads(1)
        ready.wait()  # every pool thread takes one of these tasks: none is left to a thread already set
        return torch.get_num_threads()

    pool = ThreadPoolExecutor(threads, thread_name_prefix="prompt-logprobs")
    counts = list(pool.map(one_thread, range(threads)))
    torch.set_num_threads(caller)
    if counts != [1] * threads:
        raise RuntimeError(f"chunk_pool: expected its threads to run torch on 1 thread each, got {counts}")
    _POOL.append((threads, os.getpid(), pool))
    return pool
