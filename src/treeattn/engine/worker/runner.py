"""The per-rank side of the engine: run one step's plan through the model on this rank.

Every rank of the group gets the same StepPlan (treeattn.engine.scheduler). The step's tokens of
all sequences form one flat row (1, T), whatever their sequences and positions. A step of few
tokens (decoding) is replicated: every rank runs all T tokens through the model. A step of at
least token_parallel.SPLIT_MIN_TOKENS_PER_RANK tokens per rank (prompt chunks) is token-parallel:
rank r runs only its slice of the row, and the injected callables gather the slices' keys, values
and queries so that one PagedBatch serves all T rows (treeattn.engine.worker.token_parallel). Either
way the model's two injected callables end in a PagedBatch (treeattn.engine.worker.batch: kv_store writes
this rank's new keys/values and gathers its shards, attend runs one attention call per group of
sequences, reading decoding groups' blocks in place with the paged kernel, shards run by run and
shared prefixes once where that pays; a hybrid cache's window layers locally).

Rank 0 then samples the next token of each sequence whose chunk holds its last known token (after a
token-parallel step, the final hidden states of those rows are gathered from the ranks that ran them), each
with its own torch.Generator (seeded from the request), so a request's tokens do not depend on
what it was batched with. A chunk with drafts is verified there too (_sample): see
RankRunner._sample for the rule.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist

from treeattn.cache.paged import PagedKVCache
from treeattn.cache.window import WindowKVCache, hybrid_windows, paged_layers
from treeattn.linear.hybrid import SequenceStates, check_linear_engine, linear_layers
from treeattn.engine.worker import token_parallel
from treeattn.engine.worker.batch import PagedBatch
from treeattn.engine.worker.compiled_decode import compiled_decode
from treeattn.engine.measure import RankMeasurements, RankMeter
from treeattn.engine.worker.ring_prefill import RingPrefillStep
from treeattn.engine.worker.sampling import share_maxima, split_argmax
from treeattn.engine.config import resolve_prefill
from treeattn.engine.worker.prompt_logprobs import PromptRows
from treeattn.engine.request import TokenLogprob
from treeattn.engine.scheduler import Chunk, StepPlan
from treeattn.engine.structured import MASKS_AT_SAMPLING
from treeattn.engine.worker.tensor_parallel import connect, local_heads, tensor_parallel_cuts
from treeattn.engine.worker.warmup import pretouch_cache, warm_up_rank
from treeattn.models.attention import attention_backend, group_world_size
from treeattn.models.llama import LlamaModel
from treeattn.models.packed import weight_bytes
from treeattn.parallel import comm
from treeattn.parallel.comm import comm_stats
from treeattn.parallel.shared_memory import DEFAULT_CAPACITY_BYTES, shared_memory_group

VOCAB_SPLIT_MIN_WEIGHTS = 1 << 22
"""On several CPU ranks, an output projection of at least this many weights (vocab_size x
hidden_size) is split over the ranks by vocabulary (RankRunner._vocab_share, _greedy_picks): below, one rank's
projection costs less than the all-gather's round (about 50 us through shared memory)."""


@dataclass
class StepOutcome:
    """What one step produced, on rank 0 (empty on the other ranks).

    Attributes:
        tokens: seq_id -> the new tokens of every chunk that samples (the accepted drafts and the
            token after them; one token without drafts), None where the logits were not finite.
        logprobs: seq_id -> one TokenLogprob per new token, for the chunks whose request asked.
        shared_prefix_keys: key reads per layer that reading shared blocks once saved in this step
            (treeattn.engine.worker.shared_prefix.saved_keys).
        errors: seq_id -> why sampling failed for that sequence (its tokens are None): an
            exception while sampling one request fails that request alone.
        prompt_logprobs: seq_id -> (the first prompt position scored, one TokenLogprob per scored
            prompt token of its chunk; None where a value was not finite), for the chunks of requests
            with SamplingParams.prompt_logprobs (treeattn.engine.worker.prompt_logprobs).
    """

    tokens: dict[int, list[int] | None] = field(default_factory=dict)
    logprobs: dict[int, list[TokenLogprob]] = field(default_factory=dict)
    shared_prefix_keys: int = 0
    errors: dict[int, str] = field(default_factory=dict)
    prompt_logprobs: dict[int, tuple[int, list[TokenLogprob] | None]] = field(default_factory=dict)


def all_finite(x: torch.Tensor) -> bool:
    """Whether every value of x (a float tensor, not empty) is finite: its minimum and maximum are (a
    NaN makes both NaN, an infinity one of them). One pass without a bool tensor: 29 us over Gemma 3's
    262,144 logits where torch.isfinite(x).all() took 340."""
    low, high = torch.aminmax(x)
    return math.isfinite(low) and math.isfinite(high)


def greedy_tokens(chunk: Chunk, picks: list[int | None]) -> list[int] | None:
    """The new tokens of a greedy `chunk` from the argmax of each of its num_draft + 1 rows (`picks`,
    None for a row not finite), as RankRunner._sample gives them from its logits: None if a row is not
    finite, else the drafts kept while they equal their row's argmax, then the first argmax that differs
    (or the one after the last draft).

    Example::

        >>> from treeattn.engine.scheduler import Chunk
        >>> from treeattn.engine.worker.runner import greedy_tokens
        >>> chunk = Chunk(seq_id=0, tokens=(5, 7, 8), start=10, blocks=(), sample=None, num_draft=2)
        >>> greedy_tokens(chunk, [7, 9, 4]), greedy_tokens(chunk, [7, 8, 4]), greedy_tokens(chunk, [7, 9, None])
        ([7, 9], [7, 8, 4], None)
    """
    if any(token is None for token in picks):  # never an output: the driver fails this request alone
        return None
    return verify_drafts(chunk, lambda i, kept: picks[i])


def verify_drafts(chunk: Chunk, token_at) -> list[int]:
    """The rule that verifies a chunk's drafts: position i's token is token_at(i, the tokens kept before it);
    drafts are kept while they equal their position's token, and the first token that differs from its
    draft, or the one after the last draft, ends the run.

    Example::

        >>> from treeattn.engine.scheduler import Chunk
        >>> from treeattn.engine.worker.runner import verify_drafts
        >>> chunk = Chunk(seq_id=0, tokens=(5, 7, 8), start=10, blocks=(), sample=None, num_draft=2)
        >>> verify_drafts(chunk, lambda i, kept: [7, 9, 4][i]), verify_drafts(chunk, lambda i, kept: [7, 8, 4][i])
        ([7, 9], [7, 8, 4])
    """
    drafts = chunk.tokens[len(chunk.tokens) - chunk.num_draft :]
    tokens = []
    for i in range(chunk.num_draft + 1):
        tokens.append(token_at(i, tokens))
        if i == chunk.num_draft or tokens[i] != drafts[i]:
            break
    return tokens


def token_logprobs(logits: torch.Tensor, tokens: list[int], top: int) -> list[TokenLogprob]:
    """Each token's log-probability under the model and the `top` most likely tokens.

    Args:
        logits: (len(tokens) or more, V) the rows that predicted tokens[0], tokens[1], ... (any float dtype).
        tokens: the chosen token of each row.
        top: alternatives per token (0: none).

    Returns:
        One TokenLogprob per token: log-softmax of the float32 logits (before temperature, top-k, top-p).
    """
    logp = torch.log_softmax(logits[: len(tokens)].float(), dim=-1)
    chosen = logp[torch.arange(len(tokens)), torch.tensor(tokens)].tolist()
    if top == 0:
        return [TokenLogprob(lp) for lp in chosen]
    values, ids = logp.topk(top, dim=-1)
    return [TokenLogprob(lp, tuple(zip(i, v))) for lp, i, v in zip(chosen, ids.tolist(), values.tolist())]


class RankRunner:
    """Runs step plans on one rank: the model, this rank's cache blocks, its attention back end.

    Args:
        model: the LlamaModel (the same weights on every rank).
        group: the process group (None: the world, or one process without torch.distributed).
        blocks_per_rank, block_size: of the engine's cache.
        decode: "tree", "ring" or "local"; method, topology: tree_decode's.
        shared_memory: combine through shared memory (treeattn.parallel.shared_memory) when every
            rank runs on this host and the model is on the CPU; a rank missing for timeout_s
            seconds then makes the others raise.
        draft_model: a draft model for speculate="draft" (treeattn.engine.worker.draft.DraftRunner: its own
            cache of the same blocks; it fills in each step's drafts before the model verifies them).
        decode_step: "dynamic", or "static" / "graph": steps of one token per sequence run as a
            treeattn.engine.worker.static_step.StaticDecodeStep (batch buckets up to max_batch_size).
        kv_cache_dtype: the dtype the paged KV cache stores (None: the model's); attention reads it
            in the model's dtype, accumulating in float32 (treeattn.cache.paged).
        helix: the Helix layout's HelixGroups (treeattn.engine.worker.tensor_parallel; the model holds this
            rank's share of the weights): the cache holds this rank's KV heads and its KV group's
            blocks (kv_rank), attention combines over the KV group, the model's all-reduces and the
            LM head's gather run over `group`, and every rank runs every token of a step. None: no
            tensor parallelism.
    """

    def __init__(self, model: LlamaModel, *, group: dist.ProcessGroup | None, blocks_per_rank: int, block_size: int,
                 decode: str, method: str = "allreduce", topology=None, shared_memory: bool = False,
                 timeout_s: float = 120.0, draft_model: LlamaModel | None = None, decode_step: str = "dynamic",
                 max_batch_size: int = 16, prefill: str = "auto", kv_cache_dtype: torch.dtype | None = None,
                 helix=None) -> None:
        self.model, self.group = model.eval(), group
        distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank(group) if distributed else 0
        c = model.config
        # The Helix layout (treeattn.engine.worker.tensor_parallel: `helix` its HelixGroups, the model already
        # parallelized): attention and the cache over this rank's KV group and heads, the rest over all ranks.
        self.helix = helix
        self.kv_rank = self.rank if helix is None else helix.layout.kv_index
        attention_group = group if helix is None else helix.kv
        num_kv_heads = c.num_kv_heads if helix is None else local_heads(c, helix.layout)[1]
        # A hybrid model (window and global layers, e.g. Gemma 3): the paged cache holds the global
        # layers, sharded; the window layers' last W - 1 positions per sequence stay on every rank
        # (treeattn.cache.window).
        windows, layers = hybrid_windows(c.layer_windows), paged_layers(c.layer_windows)
        # A hybrid linear model (treeattn.linear: some layers linearized): the paged cache holds the
        # softmax layers; each sequence's linear states stay on every rank, and every step runs
        # every token on every rank (no token-parallel or ring prefill), so they need no communication.
        linear = linear_layers(model)
        self.linear_states = SequenceStates() if linear else None
        if linear:
            check_linear_engine(linear, decode_step=decode_step, speculate="draft" if draft_model is not None else None,
                                windows=bool(windows))
            layers = [i for i in layers if i not in linear]
        kv_cache_dtype = kv_cache_dtype or model.dtype
        self.cache = PagedKVCache(num_layers=len(layers), num_kv_heads=num_kv_heads, head_dim=c.head_dim,
                                  value_dim=c.cache_value_dim,
                                  num_blocks=blocks_per_rank, block_size=block_size, dtype=kv_cache_dtype, device=model.device,
                                  compute_dtype=model.dtype)
        self.windows = WindowKVCache(windows, num_kv_heads=num_kv_heads, head_dim=c.head_dim, dtype=kv_cache_dtype,
                                     device=model.device, compute_dtype=model.dtype) if windows else None
        self.paged_index = {layer: i for i, layer in enumerate(layers)} if windows or linear else None
        if windows and decode_step != "dynamic":
            raise ValueError(f"decode_step={decode_step!r} does not run a hybrid KV cache (the sliding-window layers of "
                             f"{c.architecture}); use decode_step='dynamic'")
        self.world_size = p = group_world_size(group)
        self.prefill = resolve_prefill(prefill, p, c.layer_windows)  # of a prompt-only step that splits
        self._split_vocab = p > 1 and (helix is not None or (model.device.type == "cpu" and c.vocab_size * c.hidden_size
                                                             >= VOCAB_SPLIT_MIN_WEIGHTS))
        self.comm_group, self.attention_group = self._groups(group, attention_group, shared_memory, timeout_s)
        self._topology, self._windowless = topology, all(c.layer_windows[layer] is None for layer in layers)
        self._use_decode(decode, method)
        self.drafter = None
        if draft_model is not None:
            from treeattn.engine.worker.draft import DraftRunner

            windowless = all(w is None for w in draft_model.config.layer_windows)
            self.drafter = DraftRunner(draft_model, rank=self.rank, blocks_per_rank=blocks_per_rank, block_size=block_size,
                                       attend=self.attend, combine=self.combine if windowless else None, group=self.comm_group,
                                       kv_rank=None if helix is None else self.kv_rank)
        self.static_step = None
        if decode_step != "dynamic":
            from treeattn.engine.worker.static_step import StaticDecodeStep

            self.static_step = StaticDecodeStep(model, self.cache, rank=self.kv_rank, max_batch_size=max_batch_size,
                                                decode=decode,
                                                method=method, group=self.attention_group, topology=topology,
                                                graph=decode_step == "graph")
        self._generators: dict[int, torch.Generator] = {}
        # rank 0: how a step's structured-output masks arrive (a callable returning its StepMasks), set by
        # whoever gives it plans (rank.rank_main: the driver's next message; GroupChannel: filled in place)
        self.receive_masks = None
        self.meter = RankMeter(self.rank)
        # numba's kernels compiled or loaded now, not inside the first request's steps, and the KV arenas
        # written once, so that their memory is resident from the start (engine.worker.warmup)
        # decode steps of a packed Llama-family model through compiled segments (None: the model's modules)
        self.compiled_decode = compiled_decode(model, self.cache, tensor_parallel=helix is not None)
        segments = self.compiled_decode is not None
        gemma = segments and self.compiled_decode.gemma
        self.warmed = warm_up_rank(model, kv_dtype=kv_cache_dtype, world_size=p, draft_model=draft_model,
                                   decode_segments=segments and not gemma, gemma_segments=gemma)
        self.pretouched_bytes = sum(pretouch_cache(c) for c in (self.cache, getattr(self.drafter, "cache",
                                                                                    None)) if c is not None)

    def set_decode(self, decode: str, method: str) -> None:
        """Decode from the next step on with `decode` ("tree" or "ring"; every kind is local
        attention on one rank) and tree_decode's `method`. The caches stay: requests that follow
        find their prefixes as before (the engine's set_decode). Refused (ValueError) with a draft
        model or static decode steps, which were built for the engine's decode."""
        if self.drafter is not None or self.static_step is not None:
            raise ValueError(f"set_decode({decode!r}, {method!r}): an engine with a draft model or decode_step "
                             "'static'/'graph' keeps the decode it was built with")
        self._use_decode(decode if self.world_size > 1 else "local", method)

    def _groups(self, group, attention_group, shared_memory: bool, timeout_s: float):
        """(the group of all ranks' collectives: a token-parallel step's, the vocabulary's gather, the
        Helix layout's all-reduces; the group attention combines over), through shared memory where
        asked and possible. Sized, with a split vocabulary, for _gather_vocab's all-gather of one decode
        row (a rank's share of the float32 logits). Without the Helix layout they are one group."""
        c, p, device = self.model.config, self.world_size, self.model.device
        capacity = max(DEFAULT_CAPACITY_BYTES, 4 * -(-c.vocab_size // p)) if self._split_vocab else DEFAULT_CAPACITY_BYTES
        if shared_memory:
            group = shared_memory_group(group, device=device, timeout_s=timeout_s, capacity_bytes=capacity)
        if self.helix is None:
            return group, group
        layout = self.helix.layout
        tp_group = self.helix.tp if 1 < layout.tp < p else None  # o_proj's sum (T = N: over `group`; T = 1: none)
        if shared_memory:
            attention_group = shared_memory_group(attention_group, device=device, timeout_s=timeout_s)
            if tp_group is not None:
                tp_group = shared_memory_group(tp_group, device=device, timeout_s=timeout_s)
        # the model holds its share (make_runner): o_proj's all-reduce goes through tp_group, the MLP's through `group`
        connect(self.model, layout, tensor_parallel_cuts(c, layout), group, tp_group)
        return group, attention_group

    def _use_decode(self, decode: str, method: str) -> None:
        """self.attend (the decode attention) and self.combine (how a run-by-run read combines across
        ranks; None: always gather) for `decode` and `method`."""
        group, p = self.attention_group, group_world_size(comm.process_group(self.attention_group))
        self.attend = attention_backend(decode, method=method, group=group, topology=self._topology)
        self.combine = None
        if (decode != "ring" or p == 1) and self._windowless:
            from treeattn.parallel import Topology

            self.combine = (group, method, (self._topology or Topology()).resolve(p) if method == "twolevel" else 1)

    def step(self, plan: StepPlan) -> StepOutcome:
        """Run one step (see _step), counting what it communicated in self.meter."""
        if not plan.chunks:
            return self._step(plan)
        kind = "decode" if all(c.decoding for c in plan.chunks) else "prefill"
        self.meter.begin(kind)
        self._phases: dict[str, float] = {}
        start = time.perf_counter()
        with comm_stats() as comm:
            outcome = self._step(plan)
        self.meter.end(kind, comm, time.perf_counter() - start, self._phases)
        return outcome

    def measurements(self, reset: bool = False) -> RankMeasurements:
        """This rank's counters since the last reset (treeattn.engine.measure); reset=True then
        starts them anew."""
        kv_bytes = self.cache.nbytes() + (self.drafter.cache.nbytes() if self.drafter is not None else 0)
        kv_bytes += self.windows.nbytes() if self.windows is not None else 0
        kv_bytes += self.linear_states.nbytes() if self.linear_states is not None else 0
        out = self.meter.read(kv_bytes, weight_bytes(self.model))
        if reset:
            self.meter.reset()
        return out

    @torch.inference_mode()
    def _step(self, plan: StepPlan) -> StepOutcome:
        """Run one step. Returns, on rank 0, the new tokens of every chunk that samples (the next
        token, preceded by the accepted drafts of a chunk with drafts; None where the logits were
        not finite) and their log-probabilities where asked; an empty StepOutcome on the other ranks."""
        if self.windows is not None:  # a hybrid model's window checkpoints (the scheduler's order)
            for seq_id, end, checkpoint in plan.window_saves:
                self.windows.save(seq_id, end, checkpoint)
            for seq_id, checkpoint in plan.window_restores:
                self.windows.restore(seq_id, checkpoint)
            for checkpoint in plan.window_drops:
                self.windows.drop(checkpoint)
        for seq_id in plan.release:
            self._generators.pop(seq_id, None)
            if self.windows is not None:
                self.windows.release(seq_id)
            if self.linear_states is not None:
                self.linear_states.release(seq_id)
        if not plan.chunks:
            return StepOutcome()
        if self.drafter is not None:  # the drafts' placeholders -> the draft model's tokens
            plan = self.drafter.draft(plan)
        sampling = [(i, c) for i, c in enumerate(plan.chunks) if c.sample is not None]
        scored = any(c.targets for c in plan.chunks)  # prompt logprobs: never a static step
        if self.static_step is not None and not scored and self.static_step.takes(plan):  # one row per chunk
            return self._outcome(sampling, self.static_step(plan)[[i for i, _ in sampling]])
        batch = PagedBatch(plan, self.kv_rank, self.cache, self.attend, self.combine, self._phases, self.windows,
                           self.paged_index,
                           self.linear_states)
        ends = [batch.offsets[i] + len(c.tokens) for i, c in sampling]  # rows: the last known token, then the drafts
        rows = [row for (_, c), end in zip(sampling, ends) for row in range(end - c.num_draft - 1, end)]
        owned = None  # per rank, the rows whose final states it holds (None: every rank holds all)
        # Helix: every rank runs every token; a hybrid linear model too
        split = self.helix is None and self.linear_states is None and token_parallel.splits(batch.tokens.shape[1],
                                                                                            self.world_size)
        if split and self.prefill == "ring" and not any(c.decoding for c in plan.chunks):  # rank r runs its zigzag pieces
            step = RingPrefillStep(batch, plan.chunks, self.rank, self.world_size, self.comm_group)
            hidden, local, owned = step.forward(self.model, rows), step.hidden, step.every_rank_rows
        elif split:  # rank r runs its slice of the tokens
            step = token_parallel.TokenParallelStep(batch, self.rank, self.world_size, self.comm_group)
            hidden, local = step.forward(self.model, rows), step.hidden
            owned = [range(lo, hi) for lo, hi in zip(step.bounds, step.bounds[1:])]
        else:  # every rank runs every token (a hybrid linear model's batch is its own kv_store: it has .linear)
            local = self.compiled_decode.forward(batch) if self.compiled_decode is not None else None
            if local is None:  # not a step the compiled segments run (engine.worker.compiled_decode): the modules
                kv_store = batch if self.linear_states is not None else batch.kv_store
                local = self.model(batch.tokens, batch.positions, kv_store, batch.attend)[0]
            hidden = local[rows]
        prompt = PromptRows.of(plan.chunks, batch.offsets) if scored else None
        packed = prompt.compute(self.model, owned, local, self.rank, self.comm_group) if prompt is not None else None
        outcome = self._outcome(sampling, hidden, batch.shared_keys)
        if packed is not None:
            outcome.prompt_logprobs = prompt.unpack(packed)
        return outcome

    def _outcome(self, sampling: list[tuple[int, Chunk]], hidden: torch.Tensor, shared_keys: int = 0) -> StepOutcome:
        """Rank 0 samples each chunk of `sampling` from `hidden`, the final hidden states of their rows
        (num_draft + 1 per chunk, in order, on every rank); the other ranks return an empty
        StepOutcome. On several CPU ranks with a large output projection (VOCAB_SPLIT_MIN_WEIGHTS)
        each rank first computes the logits of its share of the vocabulary (_vocab_share); rank 0 then
        gets all of them (_gather_vocab) or, when every chunk samples greedily without logprobs, logit
        bias, penalties or masks, only each share's maxima (_greedy_picks).
        shared_keys: the step's StepOutcome.shared_prefix_keys."""
        if not sampling or (self.rank != 0 and not self._split_vocab):
            return StepOutcome()
        start = time.perf_counter()
        logits, picks = None, None
        if self._split_vocab:
            mine = self._vocab_share(hidden)
            picks = self._greedy_picks(sampling, mine)
            logits = self._gather_vocab(mine) if picks is None else None
        else:
            logits = self.model.logits(hidden)
        if self.rank != 0:  # this rank's share (or its maxima) went to rank 0
            self._phases["sampling"] = time.perf_counter() - start
            return StepOutcome()
        out, first = StepOutcome(shared_prefix_keys=shared_keys), 0
        masks = self._step_masks(sampling) if picks is None else None  # greedy picks: no chunk is marked
        for _, c in sampling:
            if picks is not None:  # after the step's last collective, on rank 0 alone
                out.tokens[c.seq_id] = greedy_tokens(c, picks[first : first + c.num_draft + 1])
                first += c.num_draft + 1
                continue
            chunk_logits = logits[first : first + c.num_draft + 1]
            first += c.num_draft + 1
            try:  # after the step's last collective, on rank 0 alone: a failure here is this request's
                if masks is not None and c.sample.allowed == MASKS_AT_SAMPLING:
                    c = replace(c, sample=replace(c.sample, allowed=masks.for_chunk(c.seq_id)))
                tokens = out.tokens[c.seq_id] = self._sample(c, chunk_logits)
                if tokens is not None and c.sample.logprobs is not None:
                    out.logprobs[c.seq_id] = token_logprobs(chunk_logits, tokens, c.sample.logprobs)
            except Exception as exc:  # noqa: BLE001 -- fails this sequence alone (StepOutcome.errors)
                out.tokens[c.seq_id] = None
                out.logprobs.pop(c.seq_id, None)
                out.errors[c.seq_id] = f"sampling failed: {type(exc).__name__}: {exc}"
        self._phases["sampling"] = time.perf_counter() - start
        return out

    def _step_masks(self, sampling: list[tuple[int, Chunk]]):
        """Rank 0: the step's StepMasks (engine.structured) if a chunk of `sampling` is marked
        MASKS_AT_SAMPLING, from self.receive_masks (the driver fills them while the step ran); the
        seconds waited for them are the step's "mask_wait" phase. None when no chunk is marked."""
        if not any(c.sample.allowed == MASKS_AT_SAMPLING for _, c in sampling):
            return None
        start = time.perf_counter()
        try:
            return self.receive_masks() if self.receive_masks is not None else None
        finally:
            self._phases["mask_wait"] = time.perf_counter() - start

    def _vocab_share(self, hidden: torch.Tensor) -> torch.Tensor:
        """This rank's share of the output projection split over the ranks by vocabulary: the float32
        logits (rows, n_r) of token ids [r * n, min((r + 1) * n, V)), n = ceil(V / p) (short or empty for
        the last ranks). The values are the one-rank call's (each logit is one dot product, the same
        one). On a CPU rank of one thread the projection is a step's largest matrix (SmolLM2: 49152 x
        576), which rank 0 alone ran while the others waited for its token."""
        vocab, p = self.model.config.vocab_size, self.world_size
        share = -(-vocab // p)  # the Helix layout's LM head holds this rank's share alone
        return self.model.logits(hidden, None if self.helix is not None else slice(self.rank * share, (self.rank + 1) * share))

    def _gather_vocab(self, mine: torch.Tensor) -> torch.Tensor | None:
        """One all-gather brings every rank's share (_vocab_share) to rank 0, which returns all
        (rows, V) float32 logits; the other ranks return None."""
        vocab, p = self.model.config.vocab_size, self.world_size
        share = -(-vocab // p)
        if mine.shape[-1] < share:  # the last ranks' shares are short (or empty): pad, rank 0 drops the padding
            mine = torch.cat((mine, mine.new_zeros(*mine.shape[:-1], share - mine.shape[-1])), dim=-1)
        pieces = comm.all_gather(mine.contiguous(), self.comm_group)
        return torch.cat(pieces, dim=-1)[..., :vocab] if self.rank == 0 else None

    def _greedy_picks(self, sampling: list[tuple[int, Chunk]], mine: torch.Tensor) -> list[int | None] | None:
        """A split vocabulary's greedy step without the logits' all-gather: when every chunk of
        `sampling` is greedy (temperature 0) without logprobs, each rank sends its share's maxima
        (sampling.share_maxima: rows x 3 values) in one small all-gather and rank 0 picks each row's
        token from them (sampling.split_argmax: torch.argmax's over the whole row; None for a row not
        finite). Both fields travel in the plan's ranks' part, so every rank takes the same branch. Rank
        0 alone reads the logit bias, penalties and structured-output masks: if a chunk has any, its flag
        in the gather sends every rank on to the full all-gather. Returns rank 0's picks ([] on the
        other ranks), or None on every rank when the step needs the full logits (_gather_vocab)."""
        if not all(c.sample.temperature == 0 and c.sample.logprobs is None for _, c in sampling):
            return None
        full = self.rank == 0 and any(c.sample.logit_bias or c.sample.penalized or c.sample.allowed is not None
                                      for _, c in sampling)
        share = -(-self.model.config.vocab_size // self.world_size)
        maxima = share_maxima(mine, self.rank * share)
        flag = maxima.new_tensor([[float(full), 0.0, 0.0]])  # a last row: rank 0's "needs the full logits"
        pieces = comm.all_gather(torch.cat((maxima, flag)), self.comm_group)
        if float(pieces[0][-1, 0]) != 0:
            return None
        return split_argmax(torch.stack([piece[:-1] for piece in pieces])) if self.rank == 0 else []

    def _sample(self, chunk: Chunk, logits: torch.Tensor) -> list[int] | None:
        """The new tokens of `chunk` from its logits (num_draft + 1, V) float32: the next token,
        or with drafts the accepted ones and the token after them; None if the logits are not finite.

        Drafts are verified by sampling each position in turn, exactly as decoding without drafts
        would (one draw from the request's generator per token, none when greedy), and keeping
        drafts while they equal the sampled token; the first sampled token that differs from its
        draft, or the one after the last draft, ends the run. For a drafter that proposes one token
        (prompt lookup, a draft model's argmax: all its mass q on the draft x) this is the
        speculative-sampling rule (treeattn.engine.speculate): x is kept with probability p(x) =
        min(1, p(x) / q(x)), and otherwise the token is drawn from p without x, the residual max(0, p - q)
        normalized. Its
        draws are coupled to decoding's: the same seed gives the same tokens with speculation or
        without, whatever the batch, the prefix cache or the drafts (greedy: the argmax, always).
        """
        from treeattn.engine.worker.sampling import sample
        from treeattn.engine.structured import apply_mask

        if chunk.sample.allowed == MASKS_AT_SAMPLING:
            raise ValueError("structured output: no mask came for this step (the driver sent none)")
        spec = chunk.sample
        generator = self._generators.get(chunk.seq_id)
        if generator is None:
            generator = self._generators[chunk.seq_id] = torch.Generator().manual_seed(spec.seed)
        if not all_finite(logits):  # never an output: the driver fails this request alone
            return None

        def token_at(i: int, kept: list[int]) -> int:  # a penalty counts the drafts kept before position i as output
            history = dict(prompt_ids=spec.prompt_ids, output_ids=spec.output_ids + tuple(kept)) if spec.penalized else {}
            row = logits[i : i + 1] if spec.allowed is None else apply_mask(logits[i : i + 1], spec.allowed[i])
            return int(sample(row, spec, generator, **history)[0])

        return verify_drafts(chunk, token_at)
