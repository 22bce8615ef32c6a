"""Speculative decoding with a draft model in the engine (speculate="draft"): every rank runs it.

Placement: every rank holds the draft model and a second PagedKVCache for it, with as many blocks
as the model's and indexed by the SAME block tables, so block (rank r, index i) holds the same
tokens in both caches. The draft's cache is therefore sharded exactly like the model's, and
placement, prefix-cache sharing, preemption and rollback need nothing of their own: a block id
means the same tokens in both. (Measured for one prompt in docs/benchmarks.md, "Speculative
decoding with a draft model": over the shared-memory transport the sharded draft cache drafts
8-15% faster per token than a whole one on rank 0, and prefills about twice as fast.)

One step (DraftRunner.draft, before the model's verification forward pass of the same plan):

1. The draft model runs every token the model runs in this step except the drafts: the prefill
   chunks whole and each decoding sequence's last known token, preceded by the token its cache
   still lacks (Chunk.draft_prefix: the last draft of a step that accepted them all, which was
   proposed but never run through the draft). Its logits after the last known token give draft 1.
2. Drafts 2..k: one batched one-token forward pass per draft over the decoding sequences that
   still draft (each runs its previous draft at the next position).

Attention goes through the ranks' back end (tree_decode / ring_decode across the ranks, as the
model's does). Rank 0 picks every draft and broadcasts them before the next pass (shared memory
when the group has it): every rank must run the same tokens, and the ranks' hidden states may
differ in their last bits (ring_decode merges in a different order on every rank), so they
cannot each pick their own.

Drafts are the draft model's argmax whatever the temperature: the proposal q is one-hot, and then
the model's verification in RankRunner._sample (sample each position as decoding would, keep drafts
while they equal the sampled token) is exactly the speculative-sampling rule
(treeattn.engine.speculate). The output is then not only distributed as without speculation: it is
the same tokens, seed by seed, which tests can check token by token. A sampled proposal would be
accepted more often when both distributions are spread (sum_x min(p, q) against p(argmax q)), but
needs rank 0 to keep q per draft and its own draws; exactness that can be checked came first. A
non-finite draft logit proposes whatever argmax returns: any id is a valid draft, verification
keeps the output exact.

Rejected drafts' draft keys/values lie past the sequence's computed tokens, like the model's:
invisible, overwritten later, their blocks returned by the scheduler's rollback.
"""

from __future__ import annotations

import dataclasses

import torch

from treeattn.cache.paged import PagedKVCache
from treeattn.engine.worker import token_parallel
from treeattn.engine.worker.batch import PagedBatch
from treeattn.engine.scheduler import Chunk, StepPlan
from treeattn.models.attention import group_world_size
from treeattn.parallel import comm


class DraftRunner:
    """The draft model on one rank: its share of the draft cache, and the drafting of a step.

    Args:
        model: the draft model (a LlamaModel of the model's tokenizer, dtype and device).
        rank: this rank in the group.
        blocks_per_rank, block_size: of the engine's cache (the draft's cache has the same blocks).
        attend: the rank's attention back end (the model's: models.attention.attention_backend).
        combine: how a run-by-run read combines across the ranks (PagedBatch's), or None.
        group: the group of the drafts' broadcast (the shared-memory group where there is one).
        kv_rank: the rank whose blocks this rank holds in the Helix layout (its KV group's index; the
            draft model stays whole, its cache holds all its heads, sharded over the KV group as
            `attend` and `combine` are); None: `rank`. Steps then run every token on every rank.
    """

    def __init__(self, model, *, rank: int, blocks_per_rank: int, block_size: int, attend, combine, group,
                 kv_rank: int | None = None) -> None:
        c = model.config
        self.model, self.rank, self.attend, self.combine, self.group = model.eval(), rank, attend, combine, group
        self.kv_rank, self.split = rank if kv_rank is None else kv_rank, kv_rank is None
        self.world_size = group_world_size(group)
        self.cache = PagedKVCache(num_layers=c.num_layers, num_kv_heads=c.num_kv_heads, head_dim=c.head_dim,
                                  value_dim=c.cache_value_dim,
                                  num_blocks=blocks_per_rank, block_size=block_size, dtype=model.dtype, device=model.device)

    @torch.inference_mode()
    def draft(self, plan: StepPlan) -> StepPlan:
        """Run the draft model over the step's new tokens and draft each decoding chunk's num_draft
        tokens; returns the plan with the drafts in place of the placeholders (the same on every rank)."""
        drafting = [c for c in plan.chunks if c.num_draft]
        first = [_catch_up(c) for c in plan.chunks]
        hidden = self._run(first, [i for i, c in enumerate(plan.chunks) if c.num_draft])
        drafts = [[token] for token in self._pick(hidden)]
        for i in range(1, max((c.num_draft for c in drafting), default=0)):  # draft i + 1 of those that want it
            still = [j for j, c in enumerate(drafting) if c.num_draft > i]
            step = [Chunk(drafting[j].seq_id, (drafts[j][-1],), drafting[j].start + i, drafting[j].blocks, None) for j in still]
            for j, token in zip(still, self._pick(self._run(step, range(len(step))))):
                drafts[j].append(token)
        filled = {c.seq_id: c.tokens[: len(c.tokens) - c.num_draft] + tuple(d) for c, d in zip(drafting, drafts)}
        return dataclasses.replace(plan, chunks=tuple(dataclasses.replace(c, tokens=filled[c.seq_id]) if c.num_draft else c
                                                      for c in plan.chunks))

    def _run(self, chunks: list[Chunk], last_of) -> torch.Tensor:
        """One draft forward pass over `chunks` (their keys/values into the draft's cache), token-parallel
        where the model's step would be (treeattn.engine.worker.token_parallel); returns the final hidden states
        (n, hidden_size) after the last token of chunks[i] for each i in `last_of`."""
        batch = PagedBatch(StepPlan(tuple(chunks)), self.kv_rank, self.cache, self.attend, self.combine)
        rows = [batch.offsets[i] + len(chunks[i].tokens) - 1 for i in last_of]
        if self.split and token_parallel.splits(batch.tokens.shape[1], self.world_size):
            return token_parallel.TokenParallelStep(batch, self.rank, self.world_size, self.group).forward(self.model, rows)
        return self.model(batch.tokens, batch.positions, batch.kv_store, batch.attend)[0, rows]

    def _pick(self, hidden: torch.Tensor) -> list[int]:
        """The draft model's argmax after each row of `hidden` (n, hidden_size), picked on rank 0 and
        broadcast: the same n ints on every rank."""
        if not len(hidden):  # the same on every rank: no collective
            return []
        tokens = torch.zeros(len(hidden), dtype=torch.int64, device=self.model.device)
        if self.rank == 0:
            tokens = self.model.logits(hidden).argmax(dim=-1)
        if self.world_size > 1:
            tokens = comm.broadcast(tokens.contiguous(), 0, self.group)
        return tokens.tolist()


def _catch_up(chunk: Chunk) -> Chunk:
    """What the draft model runs of `chunk` first: the tokens its cache lacks and the chunk's own
    tokens, without the drafts (not known yet)."""
    lag = len(chunk.draft_prefix)
    known = chunk.tokens[: len(chunk.tokens) - chunk.num_draft]
    return Chunk(chunk.seq_id, chunk.draft_prefix + known, chunk.start - lag, chunk.blocks, None)
