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
materialized: the rows are taken ROWS_PER_BLOCK at a time, and for each block one matrix product
gives its logits (ROWS_PER_BLOCK x V), from which the log-softmax at the target
(logit - logsumexp, float32 as the generated tokens' logprobs, runner.token_logprobs), the target's
rank and the top k are kept: 2 + 2k numbers a row. Those reductions run a few rows at a time
(rows_per_pass: 2 MiB of logits), so that they read the block's logits from the cache, not memory.
A GGUF file's packed output projection is dequantized once (dense_head) and kept for the next steps,
not once per block as the packed layer's own product of many rows would.

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

from dataclasses import dataclass

import torch

from treeattn.engine.request import TokenLogprob
from treeattn.engine.worker.token_parallel import gather_slices, row_bounds

ROWS_PER_BLOCK = 256
"""Prompt rows whose logits are computed at once: a block holds ROWS_PER_BLOCK x vocab_size float32
logits (Gemma 3: 256 MiB; SmolLM2: 48 MiB)."""

PASS_BYTES = 2 << 20
"""Logits whose log-softmax, rank and top k are taken together: rows_per_pass(V) rows of a block.
The reductions read the logits several times (max, exp-sum, compare, top k); over a block of 256
rows (SmolLM2: 48 MiB) every read comes from memory, over 2 MiB of rows the reads after the first
come from the cache (benchmarks/engine/prompt_logprobs_reductions.py: docs/engine.md#prompt-log-probabilities).
On the CPU only: on a GPU a block is reduced in one pass (one kernel launch per reduction, not per row).
The values are the same bit for bit: each row is reduced alone."""


def rows_per_pass(vocab_size: int) -> int:
    """Rows whose logits fill PASS_BYTES (at least 1): SmolLM2's 49,152 tokens 10, Gemma 3's 262,144 2.

    >>> from treeattn.engine.worker.prompt_logprobs import rows_per_pass
    >>> rows_per_pass(49152), rows_per_pass(262144), rows_per_pass(10**7)
    (10, 2, 1)
    """
    return max(1, PASS_BYTES // (4 * vocab_size))


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
            mine = hidden[torch.tensor([self.rows[i] for i in shares[rank]], dtype=torch.int64, device=hidden.device)]
        else:
            index = {row: i for i, row in enumerate(self.rows)}
            shares = [[index[row] for row in rows if row in index] for rows in owned]
            where = {row: i for i, row in enumerate(owned[rank])}
            mine = hidden[torch.tensor([where[self.rows[i]] for i in shares[rank]], dtype=torch.int64, device=hidden.device)]
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




def dense_head(model) -> torch.Tensor | None:
    """The float32 dequantization of `model`'s output projection when it is kept packed
    (treeattn.models.packed), else None (a plain weight is multiplied as it is).

    A packed layer multiplies more than MAX_KERNEL_ROWS rows by dequantizing its whole weight for
    each call (ops.packed_linear.packed_matmul): for the prompt rows, block after block, that
    dequantization cost about as much as the product itself (SmolLM2: 49,152 x 576). The copy is
    made once and kept on the head itself for the next steps, as long as the model lives (SmolLM2 113 MB,
    Gemma 3 270M 671 MB a rank; no process-wide cache), and model.logits(hidden, weight=copy)
    multiplies it as the packed layer would: the same values, bit for bit.

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


def score_rows(model, hidden: torch.Tensor, targets: torch.Tensor, top: int) -> torch.Tensor:
    """Each row's log-softmax at its target token and its `top` most likely tokens, ROWS_PER_BLOCK
    rows at a time (never more logits at once).

    Args:
        model: has .logits(hidden) -> float32 (rows, V).
        hidden: (n, hidden_size) final hidden states.
        targets: int64 (n,) the token each row scores.
        top: alternatives per row (0: none).

    Returns:
        float64 (n, 2 + 2 * top): logprob of the target (float32 logit - float32 logsumexp), its
        rank (1 + the tokens with a larger logit, vLLM's), the top log-probabilities (most likely
        first), the top token ids.

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
    weight = dense_head(model)
    dense = {} if weight is None else {"weight": weight}  # a packed head: its float32 copy, made once
    with torch.no_grad():  # the reductions write into `out=` tensors
        for lo in range(0, hidden.shape[0], ROWS_PER_BLOCK):
            logits = model.logits(hidden[lo : lo + ROWS_PER_BLOCK], **dense).float()  # (rows, V): one pass over the LM head
            step = rows_per_pass(logits.shape[1]) if logits.device.type == "cpu" else logits.shape[0]  # a GPU: one launch a block
            _score_block(logits, targets[lo : lo + ROWS_PER_BLOCK], top, out[lo : lo + ROWS_PER_BLOCK], step)
    return out


def _score_block(logits: torch.Tensor, targets: torch.Tensor, top: int, out: torch.Tensor, step: int) -> None:
    """score_rows' values for a block's logits (rows, V), written into `out`. The reductions that read
    every logit (logsumexp, the count of larger logits, the top k) run `step` rows at a time, small enough
    that the reads after the first come from the cache; the rest (the target's logit, the differences,
    the float64 copies) once for the block: fewer calls, the same values bit for bit."""
    n = logits.shape[0]
    chosen = logits.gather(1, targets[:, None])  # (rows, 1)
    lse = logits.new_empty(n)
    larger = torch.empty(n, dtype=torch.int64, device=logits.device)
    values, ids = logits.new_empty(n, top), torch.empty(n, top, dtype=torch.int64, device=logits.device)
    for first in range(0, n, step):
        rows, part = logits[first : first + step], slice(first, first + step)
        torch.logsumexp(rows, dim=-1, out=lse[part])
        torch.sum(rows > chosen[part], dim=-1, out=larger[part])
        if top:
            torch.topk(rows, top, dim=-1, out=(values[part], ids[part]))
    out[:, 0] = chosen.squeeze(1) - lse
    out[:, 1] = larger + 1
    if top:
        out[:, 2 : 2 + top] = values - lse[:, None]
        out[:, 2 + top :] = ids
