"""Continuous batching: which tokens of which sequences the next step runs (driver side, no tensors).

Every step the scheduler plans one batched forward pass over all running sequences:

- a sequence that is decoding runs its one new token (every running decoder, every step);
- a sequence still in its prompt runs the next chunk of it (chunked prefill): at most
  `prefill_chunk` prompt tokens per step over all such sequences, so a long new prompt is spread
  over several steps and the decoders keep going in between (`idle_prefill_chunk`, when larger,
  while no sequence decodes);
- waiting requests are admitted, first come first served, while the batch has room
  (`max_batch_size`) and their first chunk's blocks can be had. With a prefix cache, a new request
  starts from the longest cached prefix of its prompt and prefills only the rest; and a request
  whose next full block a running sequence is prefilling (the same tokens up to it) waits for that
  block to enter the cache instead of computing it too, while the requests behind it go on: n
  requests with one prompt, submitted together, prefill its full blocks once (each computes only
  its last, partial block, which is never shared).

Blocks are taken as tokens need them. When a sequence needs a block and its rank's pool is empty,
unreferenced cached blocks are evicted (least recently used first); if that is not enough, the
youngest running sequence is preempted: its blocks go back (into the prefix cache when there is
one, so that its recomputation is mostly a cache hit) and it waits at the front of the queue to
be recomputed from its prompt and the tokens it already produced. The oldest sequence therefore
always progresses, so every request that fits in the cache alone completes.

Speculative decoding (a `drafter`, prompt lookup): after every sequence has its own tokens and
their blocks, each decoding sequence gets up to `draft_tokens` drafted tokens appended to its
one-token chunk (never past max_new_tokens, hence never past the context window the engine checked
at submission). Drafts take blocks only after everything else of the step is placed, and are
dropped (in part or in whole) where blocks are short, so speculation never preempts or holds back
a request. Rank 0 keeps the accepted drafts and the token after them; complete() commits those
(a stop token or max_new_tokens inside the run cuts it) and rolls the sequence back past the
rejected drafts: their slots lie past the sequence's computed tokens, so they are invisible and
overwritten later, and blocks that hold no computed token any more go back to the pool. Only
blocks full of committed tokens ever enter the prefix cache.

With a draft model (`draft_cache=True`, speculate="draft", treeattn.engine.worker.draft) the drafter only
reserves the draft slots (placeholder tokens); the ranks' draft model writes the drafted tokens into
them, and keeps its own keys/values in a second cache indexed by the same block tables. That cache
lags the model's by one token after a step whose drafts were all accepted (the last draft was
proposed, never run through the draft model): `Sequence.draft_computed` counts the tokens it holds,
each chunk carries the ones it lacks (`draft_prefix`), and only blocks full of tokens computed in
both caches enter the prefix cache, so a block found there is valid for the draft model too.

A hybrid model (window and global layers; the prefix cache made with `checkpoints`) also needs its
window layers' last W - 1 positions to start at a cached boundary (treeattn.cache.window). After
every prefill chunk and when a sequence ends, the last full-block boundary b of its computed tokens
gets a window checkpoint (`StepPlan.window_saves`: the ranks copy the rows out of the sequence's
rings before its next step or its release) when the rings still hold [b - W + 1, b): they hold
every position written since the sequence started (at 0, or restored at a checkpoint) that is at
most SPARE_ROWS behind its last write, hence b >= last write - SPARE_ROWS. A request whose match
ends at a checkpoint starts there (`window_restores`); dropped checkpoints go in `window_drops`.

Sequences are numbered by arrival; a step's plan lists, per sequence, the tokens to run, their
first position and the sequence's block table (treeattn.cache.blocks): that is all a rank needs.
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field

import torch

from treeattn.cache.blocks import BlockRef, ShardedBlockPool, tokens_to_blocks
from treeattn.cache.prefix import PrefixCache
from treeattn.cache.window import SPARE_ROWS
from treeattn.engine.request import SamplingParams


@dataclass(frozen=True)
class SampleSpec:
    """How rank 0 picks a sequence's next token: sampling parameters and the seed of its generator;
    logprobs: None, or how many alternatives to report with each token's log-probability.

    The fields after logprobs (SamplingParams' of the same names; prompt_ids and output_ids: the
    sequence's tokens, given only when a penalty needs them) are read by rank 0 alone: the plan's words
    (plan_message) carry them past the part rank 0 broadcasts to the other ranks."""

    temperature: float
    top_k: int
    top_p: float
    seed: int
    logprobs: int | None = None
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    prompt_ids: tuple[int, ...] = ()
    output_ids: tuple[int, ...] = ()
    # structured outputs: a token bitmask per sampled position; () while they follow the plan (engine/structured.py)
    allowed: tuple[bytes, ...] | None = None

    @property
    def penalized(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1


@dataclass(frozen=True)
class Chunk:
    """The tokens one sequence runs in one step.

    Attributes:
        seq_id: the sequence.
        tokens: token ids to run (1 when decoding, then its drafts if any; up to a prefill chunk).
        start: position of tokens[0] (positions start..start+len(tokens)-1).
        blocks: the sequence's block table, logical block j first; covers every position up to
            start + len(tokens) - 1.
        sample: set when the last known token of the sequence is among these tokens (the last one,
            or the one before the drafts): rank 0 samples the next token from its logits.
        num_draft: the last num_draft tokens are drafts to verify (speculative decoding; 0 with
            none): rank 0 samples at the last num_draft + 1 positions and keeps the accepted drafts
            and the token after them. With a draft model they are placeholders the ranks replace.
        draft_prefix: with a draft model, the tokens before `start` whose keys/values the draft's
            cache lacks (at most one: the last accepted draft of the step before); () otherwise.
        prompt_logprobs: the request's SamplingParams.prompt_logprobs (k), where `targets` is set.
        targets: for a request with prompt_logprobs, the prompt tokens the chunk's first rows
            predict: targets[i] = prompt[start + i + 1] (treeattn.engine.worker.prompt_logprobs); () otherwise.
    """

    seq_id: int
    tokens: tuple[int, ...]
    start: int
    blocks: tuple[BlockRef, ...]
    sample: SampleSpec | None
    num_draft: int = 0
    draft_prefix: tuple[int, ...] = ()
    prompt_logprobs: int | None = None
    targets: tuple[int, ...] = ()

    @property
    def decoding(self) -> bool:
        """One token of the sequence's own (its last known one) and its drafts, if any."""
        return len(self.tokens) - self.num_draft == 1


@dataclass(frozen=True)
class StepPlan:
    """One step: decoding chunks first (one token, and its drafts), then longer chunks (prefills).

    Before the chunks run, every rank applies, in this order (hybrid models' window checkpoints,
    treeattn.cache.window; empty otherwise):
        window_saves: (seq_id, position b, checkpoint id): copy the sequence's window state at b.
        window_restores: (seq_id, checkpoint id): the sequence starts at that checkpoint.
        window_drops: checkpoint ids to free.
        release: sequences that ended since the last step (ranks drop their state).
    """

    chunks: tuple[Chunk, ...]
    release: tuple[int, ...] = ()
    window_saves: tuple[tuple[int, int, int], ...] = ()
    window_restores: tuple[tuple[int, int], ...] = ()
    window_drops: tuple[int, ...] = ()


@dataclass(eq=False)
class Sequence:
    """A request in the scheduler: its tokens, its blocks, how far its keys/values are computed."""

    seq_id: int
    prompt: list[int]
    params: SamplingParams
    stop_token_ids: frozenset[int]
    generated: list[int] = field(default_factory=list)
    blocks: list[BlockRef] = field(default_factory=list)
    num_computed: int = 0  # leading tokens whose keys/values are in the cache
    draft_computed: int = 0  # of which those in the draft model's cache too (with a draft model)
    cached_prompt_tokens: int | None = None  # prompt tokens found in the prefix cache at first admission
    window_from: int = 0  # hybrid models: where the ranks' window rings of the sequence started (0, or a restored checkpoint)
    written_end: int = 0  # the end of the positions its last step wrote (drafts included)
    preemptions: int = 0
    finish_reason: str | None = None
    drafted: int = 0  # draft tokens verified (speculative decoding)
    accepted: int = 0  # of which accepted
    decode_forwards: int = 0  # decoding chunks run (one token, and its drafts)
    decode_tokens: int = 0  # tokens those committed

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.generated

    @property
    def pending(self) -> int:
        """Known tokens not yet run through the model (1 while decoding)."""
        return len(self.prompt) + len(self.generated) - self.num_computed

    def sample_spec(self) -> SampleSpec:
        p = self.params
        if not p.penalized:
            return SampleSpec(p.temperature, p.top_k, p.top_p, p.seed, p.logprobs, p.min_p, logit_bias=p.logit_bias)
        prompt = tuple(self.prompt) if p.repetition_penalty != 1 else ()
        return SampleSpec(p.temperature, p.top_k, p.top_p, p.seed, p.logprobs, p.min_p, p.presence_penalty, p.frequency_penalty,
                          p.repetition_penalty, p.logit_bias, prompt, tuple(self.generated))


class Scheduler:
    """Plans steps over a ShardedBlockPool (see the module docstring).

    Args:
        pool: the blocks of every rank.
        max_batch_size: running sequences at most.
        prefill_chunk: prompt tokens per step at most, over all prefilling sequences.
        prefix_cache: a PrefixCache over `pool`, or None for no prefix reuse.
        drafter: None, or a drafter for speculative decoding: `drafter.propose(context, k)` takes
            int64 (L,) token ids (prompt and output so far) and returns int64 (d,), d <= k, the
            tokens it guesses come next (treeattn.engine.speculate.NgramDrafter), or placeholders for the
            ranks' draft model (treeattn.engine.speculate.DraftSlots).
        draft_tokens: the most tokens drafted per sequence per step.
        draft_cache: the ranks keep a draft model's cache indexed by the same block tables (see the
            module docstring).
        idle_prefill_chunk: prompt tokens per step at most while no running sequence decodes (no
            decoder waits on the prefill; the engine sets it for ring prefill steps,
            treeattn.engine.worker.ring_prefill); None: prefill_chunk always.
    """

    def __init__(self, pool: ShardedBlockPool, *, max_batch_size: int, prefill_chunk: int, prefix_cache: PrefixCache | None,
                 drafter=None, draft_tokens: int = 4, draft_cache: bool = False, idle_prefill_chunk: int | None = None) -> None:
        for name, value in (("max_batch_size", max_batch_size), ("prefill_chunk", prefill_chunk)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        self.pool = pool
        self.max_batch_size = max_batch_size
        self.prefill_chunk = prefill_chunk
        self.idle_prefill_chunk = max(prefill_chunk, idle_prefill_chunk or 0)
        self.prefix_cache = prefix_cache
        self.drafter = drafter
        self.draft_tokens = draft_tokens
        self.draft_cache = draft_cache
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # oldest first
        self._ids = itertools.count()
        self._release: list[int] = []
        self._window_saves: list[tuple[int, int, int]] = []
        self._window_restores: list[tuple[int, int]] = []
        self.prefix_hit_tokens = 0
        self.preemptions = 0
        self.drafted = self.accepted = self.decode_forwards = self.decode_tokens = 0

    # ------------------------------------------------------------------------------ requests

    def add(self, prompt: list[int], params: SamplingParams, stop_token_ids: frozenset[int]) -> Sequence:
        """Queue a request (the engine has checked that it fits alone)."""
        seq = Sequence(next(self._ids), list(prompt), params, stop_token_ids)
        self.waiting.append(seq)
        return seq

    def finish(self, seq: Sequence, reason: str) -> None:
        """End a sequence (done, cancelled or failed): its blocks go back, into the prefix cache
        when there is one (not for reason "error": its keys/values may be what failed)."""
        seq.finish_reason = reason
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._free_blocks(seq)
        self._release.append(seq.seq_id)

    def recompute_all(self) -> None:
        """Forget every sequence's keys and values (the ranks that held them were restarted): each
        running sequence goes back to waiting, oldest first, to prefill its tokens again (as a
        preemption does), and the prefix cache is emptied."""
        for seq in reversed(self.running):  # _preempt puts each at the head of waiting
            self._preempt(seq)
        if self.prefix_cache is not None:
            self.prefix_cache.clear()
        self._window_saves.clear()  # the restarted ranks hold no rings to save from

    @property
    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    # ------------------------------------------------------------------------------ planning

    def schedule(self) -> StepPlan:
        """The next step's plan (no chunks when nothing can run)."""
        decoding = any(seq.pending == 1 for seq in self.running)
        budget = self.prefill_chunk if decoding else self.idle_prefill_chunk
        planned: list[tuple[Sequence, int]] = []
        for seq in list(self.running):  # oldest first
            if seq not in self.running:  # preempted for an older one in this loop
                continue
            n = 1 if seq.pending == 1 else min(seq.pending, budget)
            if n == 0:
                continue
            n = self._make_room(seq, n, planned)
            if n == 0:
                continue
            planned.append((seq, n))
            if n > 1:
                budget -= n
        for seq in list(self.waiting):
            if len(self.running) >= self.max_batch_size:
                break
            if self._awaits_prefill(seq):  # a running sequence is computing its next block: wait for it
                continue
            n = self._admit(seq, budget)
            if n == 0:
                break
            self.waiting.remove(seq)
            self.running.append(seq)
            planned.append((seq, n))
            if n > 1:
                budget -= n
        return self._plan(planned, self._draft(planned))

    def complete(self, plan: StepPlan, sampled: dict[int, list[int] | None]) -> list[tuple[Sequence, int | None, str | None]]:
        """Record a step's outcome.

        Args:
            plan: the step that ran.
            sampled: seq_id -> the new tokens of every chunk with a sample: the accepted drafts and
                the token after them (one token without drafts); None where the logits were not finite.

        Returns:
            (sequence, token, finish reason or None) per committed token, in order; the reason is
            set on a sequence's last. A stop token or max_new_tokens inside a run of accepted
            tokens ends the sequence there; sequences that ended or failed (token None, reason
            "error") are finished here.
        """
        out = []
        by_id = {seq.seq_id: seq for seq in self.running}
        for chunk in plan.chunks:
            seq = by_id.get(chunk.seq_id)
            if seq is None:  # finished (cancelled) while the step ran
                continue
            tokens = sampled[chunk.seq_id] if chunk.sample is not None else []
            accepted = len(tokens) - 1 if tokens else 0  # drafts kept: their keys/values are computed
            seq.num_computed = chunk.start + len(chunk.tokens) - chunk.num_draft + accepted
            seq.written_end = chunk.start + len(chunk.tokens)
            if chunk.num_draft:
                self._roll_back(seq)
            if tokens is None:  # non-finite logits: this sequence fails, its blocks are not cached
                self.finish(seq, "error")
                out.append((seq, None, "error"))
                continue
            committed, reason = self._commit(seq, tokens)
            # the draft model ran every token of the chunk but the last draft (never its input)
            seq.draft_computed = min(seq.num_computed, chunk.start + len(chunk.tokens) - (chunk.num_draft > 0))
            if chunk.decoding and chunk.sample is not None:
                self._count(seq, chunk.num_draft, accepted, len(committed))
            if self.prefix_cache is not None and chunk.start < len(seq.prompt):
                # Prefilled full blocks are shared at once (RadixAttention): a request that arrives
                # while this one still runs reuses them, not only after it finishes.
                self.prefix_cache.insert(seq.tokens[: self._cacheable(seq)], seq.blocks)
                self._checkpoint(seq)
            if reason is not None:
                self.finish(seq, reason)
            out += [(seq, token, reason if i == len(committed) - 1 else None) for i, token in enumerate(committed)]
        return out

    def _commit(self, seq: Sequence, tokens: list[int]) -> tuple[list[int], str | None]:
        """Append `tokens` to seq's output up to the first stop token or max_new_tokens; returns
        the tokens appended and the finish reason ("stop", "length" or None)."""
        reason, committed = None, []
        for token in tokens:
            committed.append(token)
            if token in seq.stop_token_ids:
                reason = "stop"
            elif len(seq.generated) + len(committed) >= seq.params.max_new_tokens:
                reason = "length"
            if reason is not None:
                break
        seq.generated += committed
        seq.num_computed = min(seq.num_computed, len(seq.tokens))  # a cut run: drafts past the end are not the sequence's
        return committed, reason

    def _checkpoint(self, seq: Sequence) -> None:
        """Give the last full-block boundary of seq's cached tokens a window checkpoint where the
        ranks' rings still hold its window (see the module docstring); hybrid models only."""
        if self.prefix_cache is None or self.prefix_cache.max_checkpoints is None:
            return
        num_blocks = self._cacheable(seq) // self.pool.block_size
        end = num_blocks * self.pool.block_size
        if end == 0 or seq.written_end <= seq.window_from or end < seq.window_from or end < seq.written_end - SPARE_ROWS:
            return
        checkpoint = self.prefix_cache.add_checkpoint(seq.tokens, num_blocks)
        if checkpoint is not None:
            self._window_saves.append((seq.seq_id, end, checkpoint))

    def _cacheable(self, seq: Sequence) -> int:
        """Leading tokens of seq computed in every cache the ranks keep (what the prefix cache may take)."""
        return min(seq.num_computed, seq.draft_computed) if self.draft_cache else seq.num_computed

    def _count(self, seq: Sequence, drafted: int, accepted: int, committed: int) -> None:
        seq.drafted += drafted
        seq.accepted += accepted
        seq.decode_forwards += 1
        seq.decode_tokens += committed
        self.drafted += drafted
        self.accepted += accepted
        self.decode_forwards += 1
        self.decode_tokens += committed

    def _roll_back(self, seq: Sequence) -> None:
        """Return the blocks past seq's computed tokens (only rejected drafts were written there)."""
        keep = tokens_to_blocks(seq.num_computed, self.pool.block_size)
        for block in seq.blocks[keep:]:
            self.pool.decref(block)
        del seq.blocks[keep:]

    def _draft(self, planned: list[tuple[Sequence, int]]) -> dict[int, tuple[int, ...]]:
        """Drafts for the step's decoding sequences (seq_id -> tokens), with the blocks they need:
        taken after every sequence's own tokens are placed, from free (or evictable cached) blocks
        only; a draft that does not fit is cut."""
        drafts = {}
        if self.drafter is None:
            return drafts
        for seq, n in planned:
            room = seq.params.max_new_tokens - len(seq.generated) - 1  # tokens a full acceptance may add
            if n != 1 or seq.pending != 1 or room < 1:
                continue
            draft = self.drafter.propose(torch.tensor(seq.tokens, dtype=torch.int64), min(self.draft_tokens, room)).tolist()
            fitted = self._fit(seq, 1 + len(draft)) - 1 if draft else 0
            if fitted > 0:
                drafts[seq.seq_id] = tuple(draft[:fitted])
        return drafts

    def _plan(self, planned: list[tuple[Sequence, int]], drafts: dict[int, tuple[int, ...]]) -> StepPlan:
        chunks = []
        for seq, n in sorted(planned, key=lambda item: item[1] > 1):  # decoding chunks first, stable
            tokens = seq.tokens[seq.num_computed : seq.num_computed + n]
            sample = seq.sample_spec() if seq.num_computed + n == len(seq.prompt) + len(seq.generated) else None
            draft = drafts.get(seq.seq_id, ())
            lagging = tuple(seq.tokens[seq.draft_computed : seq.num_computed]) if self.draft_cache else ()
            k = seq.params.prompt_logprobs
            targets = tuple(seq.prompt[seq.num_computed + 1 : seq.num_computed + n + 1]) if k is not None else ()
            chunks.append(Chunk(seq.seq_id, tuple(tokens) + draft, seq.num_computed, tuple(seq.blocks), sample, len(draft),
                                lagging,
                                k if targets else None, targets))
        if not chunks:  # the driver sends no empty plan: what the ranks must do waits for the next one
            return StepPlan(())
        release, self._release = tuple(self._release), []
        saves, self._window_saves = tuple(self._window_saves), []
        restores, self._window_restores = tuple(self._window_restores), []
        drops = self.prefix_cache.take_dropped() if self.prefix_cache is not None else ()
        return StepPlan(tuple(chunks), release, saves, restores, drops)

    def _admit(self, seq: Sequence, budget: int) -> int:
        """Give the head of the queue its cached prefix and its first chunk's blocks; returns the
        tokens it runs this step (0: it cannot start now, and holds nothing)."""
        checkpoint = None
        if self.prefix_cache is not None and seq.params.prompt_logprobs is None:  # a cached prefix holds no logprobs
            blocks, checkpoint = self.prefix_cache.match_checkpointed(seq.tokens[: len(seq.tokens) - 1])  # >= 1 token left to run
            seq.blocks = blocks
            for block in seq.blocks:
                self.pool.incref(block)
        seq.num_computed = seq.draft_computed = len(seq.blocks) * self.pool.block_size
        seq.window_from = seq.written_end = seq.num_computed
        if seq.cached_prompt_tokens is None:
            seq.cached_prompt_tokens = min(seq.num_computed, len(seq.prompt))
            self.prefix_hit_tokens += seq.cached_prompt_tokens
        n = 1 if seq.pending == 1 else min(seq.pending, budget)
        n = self._fit(seq, n) if n else 0
        if n == 0:
            self._free_blocks(seq)
        elif checkpoint is not None:
            self._window_restores.append((seq.seq_id, checkpoint))
        return n

    def _awaits_prefill(self, seq: Sequence) -> bool:
        """Whether the next block `seq` would prefill (the first full block of its tokens past the
        prefix cache's match) is being prefilled by a running sequence with the same tokens up to
        it: that block enters the prefix cache when computed, so `seq` waits for it instead of
        computing it again (n requests with one prompt prefill it once)."""
        if self.prefix_cache is None or seq.params.prompt_logprobs is not None:  # it computes its whole prompt
            return False
        bs, tokens = self.pool.block_size, seq.tokens
        prefilling = [r for r in self.running if r.num_computed < len(r.prompt) and r.prompt[0] == tokens[0]]
        if not prefilling:
            return False
        end = (len(self.prefix_cache.match(tokens[: len(tokens) - 1])) + 1) * bs  # past seq's next block
        if end > len(tokens) - 1:  # its next block is its last, partial one: never cached, never shared
            return False
        return any(r.num_computed < end <= len(r.prompt) and r.prompt[:end] == tokens[:end] for r in prefilling)

    def _make_room(self, seq: Sequence, n: int, planned: list[tuple[Sequence, int]]) -> int:
        """Get the blocks for `n` more tokens of running `seq`, preempting younger sequences if
        need be. Returns how many tokens it runs (fewer than n for a prefill chunk that only fits
        in part; 0 if `seq` itself had to be preempted)."""
        while True:
            fitted = self._fit(seq, n)
            if fitted == n or (fitted > 0 and n > 1):
                return fitted
            victim = self.running[-1]
            self._preempt(victim)
            if victim is seq:
                return 0
            for i, (other, _) in enumerate(planned):
                if other is victim:  # cannot happen (victims are younger), kept for safety
                    del planned[i]
                    break

    def _fit(self, seq: Sequence, n: int) -> int:
        """Allocate the blocks for up to `n` more tokens of `seq` (evicting cached blocks if need
        be); returns how many tokens got their blocks (n, fewer, or 0)."""
        bs = self.pool.block_size
        have = len(seq.blocks)
        for target in range(tokens_to_blocks(seq.num_computed + n, bs), have - 1, -1):
            needed = self.pool.blocks_needed(have, target)
            if self.prefix_cache is not None:
                for rank, count in enumerate(needed):
                    if count > self.pool.pools[rank].num_free:
                        self.prefix_cache.evict(rank, count)
            if self.pool.can_allocate(needed):
                seq.blocks.extend(self.pool.allocate(j) for j in range(have, target))
                return max(0, min(n, target * bs - seq.num_computed))
        return 0

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._free_blocks(seq)
        seq.num_computed = seq.draft_computed = 0
        seq.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(seq)

    def _free_blocks(self, seq: Sequence) -> None:
        if self.prefix_cache is not None and seq.blocks and seq.finish_reason != "error":
            self.prefix_cache.insert(seq.tokens[: self._cacheable(seq)], seq.blocks)
            self._checkpoint(seq)
        for block in seq.blocks:
            self.pool.decref(block)
        seq.blocks = []

    def stats(self) -> dict:
        """The counters of Engine.stats(); the speculation counters (drafted_tokens, accepted_tokens,
        acceptance_rate) only with a drafter: without speculative decoding there is no rate to show."""
        out = {
            "blocks_total": self.pool.num_blocks,
            "blocks_free": self.pool.num_free,
            "blocks_used": self.pool.num_blocks - self.pool.num_free,
            "blocks_cached": self.prefix_cache.num_blocks if self.prefix_cache is not None else 0,
            "blocks_active": len({block for seq in self.running for block in seq.blocks}),  # held by running requests
            "running": len(self.running),
            "waiting": len(self.waiting),
            "prefix_hit_tokens": self.prefix_hit_tokens,
            "preemptions": self.preemptions,
            "decode_forwards": self.decode_forwards,
            "tokens_per_forward": self.decode_tokens / self.decode_forwards if self.decode_forwards else float("nan"),
        }
        if self.drafter is not None:
            out.update(drafted_tokens=self.drafted, accepted_tokens=self.accepted,
                       acceptance_rate=self.accepted / self.drafted if self.drafted else float("nan"))
        return out
