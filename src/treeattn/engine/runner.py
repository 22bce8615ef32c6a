"""The per-rank side of the engine: run one step's plan through the model on this rank.

Every rank of the group gets the same StepPlan (treeattn.engine.scheduler). The step's tokens of
all sequences form one flat row (1, T), whatever their sequences and positions. A step of few
tokens (decoding) is replicated: every rank runs all T tokens through the model. A step of at
least token_parallel.SPLIT_MIN_TOKENS_PER_RANK tokens per rank (prompt chunks) is token-parallel:
rank r runs only its slice of the row, and the injected callables gather the slices' keys, values
and queries so that the PagedBatch below serves all T rows (treeattn.engine.token_parallel). Either
way the model's two injected callables end in a PagedBatch:

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
with triton) read their blocks in place with the paged decode kernel (treeattn.ops.paged_decode): the group's block table
and key positions are checked once per step (a PagedDecodeLayout), and each layer makes one
kernel call over the arena's blocks (no gather, no GQA repeat), then one combine across the
ranks. The reads below serve every other group (prefill chunks, other dtypes and devices, no numba).

Reading a shard without copying it ("runs"): a sequence's blocks on this rank are often
physically adjacent (blocks are handed out in order, and a long prompt takes many at once). Each
maximal run of adjacent blocks is a view of the arena; attending to each run separately and
merging the states with merge_states is exact, and then one combine_states across the ranks (the
combine step of tree_decode) finishes the group. This costs one attention call per run instead of
one gather (a copy of the whole shard per layer per step), so it pays when runs are long: a group
is read this way when its runs average at least COPY_FREE_MIN_KEYS keys (tree and local decoding,
no sliding window; ring_decode passes the shard itself, so it always gathers).

Shared prefixes: decoding sequences whose block tables begin with the same blocks (a document in
the prefix cache that several requests question) read those blocks once per step for all their
query rows, then each its own blocks; the states merge, then one combine across the ranks
(treeattn.engine.shared_prefix; same conditions as run-by-run reads).

Rank 0 then samples the next token of each sequence whose chunk holds its last known token (after a
token-parallel step, the final hidden states of those rows are gathered from the ranks that ran them), each
with its own torch.Generator (seeded from the request), so a request's tokens do not depend on
what it was batched with. A chunk with drafts is verified there too (_sample): see
RankRunner._sample for the rule.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from treeattn.cache.blocks import tokens_to_blocks
from treeattn.cache.paged import PagedKVCache
from treeattn.cache.window import WindowKVCache, hybrid_windows, paged_layers
from treeattn.cache.sharded import INVISIBLE_POSITION
from treeattn.engine import shared_prefix, token_parallel
from treeattn.engine.measure import RankMeasurements, RankMeter
from treeattn.engine.ring_prefill import RingPrefillStep, resolve_prefill
from treeattn.engine.request import TokenLogprob
from treeattn.engine.scheduler import Chunk, StepPlan
from treeattn.models.attention import LocalAttention, attention_backend, group_world_size
from treeattn.models.llama import LlamaModel
from treeattn.ops import attention, merge_states_list
from treeattn.ops.paged_decode import PagedDecodeLayout, kernel_takes, paged_decode_attention
from treeattn.parallel.comm import comm_stats
from treeattn.parallel.shared_memory import shared_memory_group


# A group of sequences is read run by run (no copy) when its runs of adjacent blocks average at
# least this many keys; below, one gather and one batched call are cheaper (benchmarks/engine_paged_read.py).
COPY_FREE_MIN_KEYS = 1024
_LOCAL = LocalAttention()  # a hybrid cache's window layers: every rank attends alone


class _Group:
    """Sequences attended in one call: their queries' rows in the flat step and their shards.
    own_from: per chunk, the first logical block of its shard (the blocks before are read as
    shared segments, treeattn.engine.shared_prefix); None: from block 0."""

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
        self.q_index, self.q_pos = q_index.to(device), q_pos.to(device)
        self.table, self.kv_pos = table.to(device), kv_pos.to(device)
        self.runs = [_runs(blocks, kv_pos[b], bs, device) for b, blocks in enumerate(local)]
        num_runs = sum(len(r) for r in self.runs)
        keys = sum(len(blocks) for blocks in local) * bs
        self.copy_free = copy_free_ok and num_runs > 0 and keys >= COPY_FREE_MIN_KEYS * num_runs
        # Decoding groups read their blocks in place with the paged kernel (checked here, once per step).
        self.paged = PagedDecodeLayout(self.table, self.kv_pos, self.q_pos, block_size=bs) if paged else None
        self.shared = None  # the SharedSegments of a decoding group whose sequences share blocks


def _runs(blocks: list[tuple[int, int]], kv_pos: torch.Tensor, bs: int, device) -> list[tuple[int, int, torch.Tensor]]:
    """Maximal runs of physically adjacent blocks among one sequence's local `blocks` [(logical,
    block id)], as (first block id, number of blocks, int64 (1, n * bs) positions of their keys)."""
    runs, i = [], 0
    while i < len(blocks):
        n = 1
        while i + n < len(blocks) and blocks[i + n][1] == blocks[i][1] + n:
            n += 1
        runs.append((blocks[i][1], n, kv_pos[None, i * bs : (i + n) * bs].to(device)))
        i += n
    return runs


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
    """

    def __init__(self, plan: StepPlan, rank: int, cache: PagedKVCache, attend, combine=None, phases: dict | None = None,
                 windows: WindowKVCache | None = None, paged_index: dict[int, int] | None = None) -> None:
        device, bs = cache.device, cache.block_size
        self.cache, self.backend, self.combine = cache, attend, combine
        self.windows, self.paged_index = windows, paged_index
        self._window_layer = False
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
        paged = combine is not None and kernel_takes(cache.dtype, device)  # decoding groups: the paged kernel
        self.groups = [_Group([plan.chunks[i] for i in idx], [offsets[i] for i in idx], rank, cache, device, combine is not None,
                              own_from if idx is decoding and segments else None, paged and idx is decoding)
                       for idx in (decoding, prefill) if idx]
        self._members = [[(plan.chunks[i], offsets[i]) for i in idx] for idx in (decoding, prefill) if idx]  # per group
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
        if self.store_rows.numel():
            self.cache.write(layer, self.store_slots, k_new[0, self.store_rows], v_new[0, self.store_rows])
        self._layer = layer
        shards = [(None, None) if g.copy_free or g.paged is not None else self.cache.gather(layer, g.table) for g in self.groups]
        return tuple(k for k, _ in shards), tuple(v for _, v in shards), tuple(g.kv_pos for g in self.groups)

    def _window_store(self, layer: int, k_new: torch.Tensor, v_new: torch.Tensor):
        """A window layer's new keys/values k_new, v_new (T, Hkv, D) of the whole step go to the
        window cache, sequence by sequence; returns per group k, v (B_g, L_g, Hkv, D) and kv_pos
        (B_g, L_g): each sequence's kept rows then its new ones, padded with invisible positions."""
        ks, vs, positions = [], [], []
        for members in self._members:
            rows = [self.windows.extend(layer, c.seq_id, c.start, k_new[o : o + len(c.tokens)], v_new[o : o + len(c.tokens)],
                                        keep_from=c.start + len(c.tokens) - c.num_draft) for c, o in members]
            width = max(pos.numel() for _, _, pos in rows)
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
        call per group over what _window_store returned (every rank holds it all: no combine)."""
        start, combined = time.perf_counter(), self.phases.get("combine", 0.0)
        flat = q[0]
        out = flat.new_zeros(*flat.shape[:-1], self.cache.value_dim or flat.shape[-1])  # (T, Hq, Dv)
        for g, k_g, v_g, pos_g in zip(self.groups, k, v, kv_pos):
            if self._window_layer:
                o = _LOCAL(flat[g.q_index], k_g, v_g, q_pos=g.q_pos, kv_pos=pos_g, window=window)
            elif g.shared is not None:
                o = self._attend_shared(g, flat, k_g, v_g, pos_g)
            elif g.paged is not None:
                q_g = flat[g.q_index]
                o = self._combine(*self._paged_state(g, q_g, window)).to(q_g.dtype)
            elif g.copy_free:
                o = self._attend_runs(g, flat[g.q_index])
            else:
                o = self.backend(flat[g.q_index], k_g, v_g, q_pos=g.q_pos, kv_pos=pos_g, window=window)
            out[g.q_index[g.valid]] = o[g.valid]
        local = time.perf_counter() - start - (self.phases.get("combine", 0.0) - combined)
        self.phases["attention"] = self.phases.get("attention", 0.0) + local
        return out[None]

    def _attend_shared(self, g: _Group, flat: torch.Tensor, k_g, v_g, pos_g) -> torch.Tensor:
        """Group g's queries over its shared segments (each read once for its sequences) and each
        sequence's own blocks, merged, then combined across the ranks (treeattn.engine.shared_prefix).
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
        out, lse = paged_decode_attention(q, k, v, g.paged, window=window)
        return out.to(torch.promote_types(out.dtype, torch.float32)), lse  # the Triton kernel's out is in q.dtype

    def _attend_runs(self, g: _Group, q: torch.Tensor) -> torch.Tensor:
        """q (B, S, Hq, D) of group g over this rank's runs of blocks, merged per sequence, then
        combined across the ranks. Returns out (B, S, Hq, Dv) in q.dtype."""
        return self._combine(*self._local_runs(g, q)).to(q.dtype)

    def _local_runs(self, g: _Group, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q (B, S, Hq, D) of group g over this rank's runs of blocks, merged per sequence: this
        rank's state, out (B, S, Hq, Dv) and lse (B, Hq, S), float32 (float64 for float64 q)."""
        B, S, Hq, D = q.shape
        k, v = self.cache.blocks(self._layer)  # (blocks, block_size, Hkv, D), (..., Dv)
        Hkv, Dv = k.shape[-2], v.shape[-1]
        outs, lses = [], []
        for b, runs in enumerate(g.runs):
            states = [attention(q[b : b + 1], k[a : a + n].reshape(1, -1, Hkv, D), v[a : a + n].reshape(1, -1, Hkv, Dv),
                                causal=True, q_pos=g.q_pos[b : b + 1], kv_pos=pos) for a, n, pos in runs]
            if not states:  # nothing of this sequence here: the merge's identity
                states = [(q.new_zeros(1, S, Hq, Dv), torch.full((1, Hq, S), float("-inf"), device=q.device))]
            o, lse = merge_states_list([o for o, _ in states], [lse for _, lse in states]) if len(states) > 1 else states[0]
            acc = torch.promote_types(o.dtype, torch.float32)
            outs.append(o.to(acc))
            lses.append(lse.to(acc))
        return torch.cat(outs), torch.cat(lses)

    def _combine(self, out: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
        """This rank's state, out (B, S, Hq, Dv) and lse (B, Hq, S) float32 or float64 -> out over
        every rank's keys (tree_decode's combine step), same dtype."""
        group, method, ranks_per_node = self.combine
        if group_world_size(group) > 1:
            from treeattn.parallel.tree_decode import combine_states

            start = time.perf_counter()
            out, lse = combine_states(out, lse, group=group, method=method, ranks_per_node=ranks_per_node)
            self.phases["combine"] = self.phases.get("combine", 0.0) + time.perf_counter() - start
        return out


@dataclass
class StepOutcome:
    """What one step produced, on rank 0 (empty on the other ranks).

    Attributes:
        tokens: seq_id -> the new tokens of every chunk that samples (the accepted drafts and the
            token after them; one token without drafts), None where the logits were not finite.
        logprobs: seq_id -> one TokenLogprob per new token, for the chunks whose request asked.
        shared_prefix_keys: key reads per layer that reading shared blocks once saved in this step
            (treeattn.engine.shared_prefix.saved_keys).
    """

    tokens: dict[int, list[int] | None] = field(default_factory=dict)
    logprobs: dict[int, list[TokenLogprob]] = field(default_factory=dict)
    shared_prefix_keys: int = 0


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
        draft_model: a draft model for speculate="draft" (treeattn.engine.draft.DraftRunner: its own
            cache of the same blocks; it fills in each step's drafts before the model verifies them).
        decode_step: "dynamic", or "static" / "graph": steps of one token per sequence run as a
            treeattn.engine.static_step.StaticDecodeStep (batch buckets up to max_batch_size).
    """

    def __init__(self, model: LlamaModel, *, group: dist.ProcessGroup | None, blocks_per_rank: int, block_size: int,
                 decode: str, method: str = "allreduce", topology=None, shared_memory: bool = False,
                 timeout_s: float = 120.0, draft_model: LlamaModel | None = None, decode_step: str = "dynamic",
                 max_batch_size: int = 16, prefill: str = "auto") -> None:
        self.model, self.group = model.eval(), group
        distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank(group) if distributed else 0
        c = model.config
        # A hybrid model (window and global layers, e.g. Gemma 3): the paged cache holds the global
        # layers, sharded; the window layers' last W - 1 positions per sequence stay on every rank
        # (treeattn.cache.window).
        windows, layers = hybrid_windows(c.layer_windows), paged_layers(c.layer_windows)
        self.cache = PagedKVCache(num_layers=len(layers), num_kv_heads=c.num_kv_heads, head_dim=c.head_dim, value_dim=c.cache_value_dim,
                                  num_blocks=blocks_per_rank, block_size=block_size, dtype=model.dtype, device=model.device)
        self.windows = WindowKVCache(windows, num_kv_heads=c.num_kv_heads, head_dim=c.head_dim, dtype=model.dtype,
                                     device=model.device) if windows else None
        self.paged_index = {layer: i for i, layer in enumerate(layers)} if windows else None
        if windows and decode_step != "dynamic":
            raise ValueError(f"decode_step={decode_step!r} does not run a hybrid KV cache (the sliding-window layers of "
                             f"{c.architecture}); use decode_step='dynamic'")
        self.world_size = p = group_world_size(group)
        self.prefill = resolve_prefill(prefill, p, c.layer_windows)  # of a prompt-only step that splits
        if windows and self.prefill == "ring":
            raise ValueError(f"prefill='ring' does not run a hybrid KV cache (the sliding-window layers of {c.architecture}); "
                             f"use prefill='split' or 'auto'")
        if shared_memory:  # the group the attention combines over
            group = shared_memory_group(group, device=model.device, timeout_s=timeout_s)
        self.comm_group = group  # of the collectives of a token-parallel step
        self.attend = attention_backend(decode, method=method, group=group, topology=topology)
        self.combine = None  # how a run-by-run read combines across ranks (None: always gather)
        if (decode != "ring" or p == 1) and all(c.layer_windows[layer] is None for layer in layers):
            from treeattn.parallel import Topology

            self.combine = (group, method, (topology or Topology()).resolve(p) if method == "twolevel" else 1)
        self.drafter = None
        if draft_model is not None:
            from treeattn.engine.draft import DraftRunner

            windowless = all(w is None for w in draft_model.config.layer_windows)
            self.drafter = DraftRunner(draft_model, rank=self.rank, blocks_per_rank=blocks_per_rank, block_size=block_size,
                                       attend=self.attend, combine=self.combine if windowless else None, group=group)
        self.static_step = None
        if decode_step != "dynamic":
            from treeattn.engine.static_step import StaticDecodeStep

            self.static_step = StaticDecodeStep(model, self.cache, rank=self.rank, max_batch_size=max_batch_size, decode=decode,
                                                method=method, group=group, topology=topology, graph=decode_step == "graph")
        self._generators: dict[int, torch.Generator] = {}
        self.meter = RankMeter(self.rank)

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
        out = self.meter.read(kv_bytes)
        if reset:
            self.meter.reset()
        return out

    @torch.inference_mode()
    def _step(self, plan: StepPlan) -> StepOutcome:
        """Run one step. Returns, on rank 0, the new tokens of every chunk that samples (the next
        token, preceded by the accepted drafts of a chunk with drafts; None where the logits were
        not finite) and their log-probabilities where asked; an empty StepOutcome on the other ranks."""
        for seq_id in plan.release:
            self._generators.pop(seq_id, None)
            if self.windows is not None:
                self.windows.release(seq_id)
        if not plan.chunks:
            return StepOutcome()
        if self.drafter is not None:  # the drafts' placeholders -> the draft model's tokens
            plan = self.drafter.draft(plan)
        sampling = [(i, c) for i, c in enumerate(plan.chunks) if c.sample is not None]
        if self.static_step is not None and self.static_step.takes(plan):  # one row per chunk
            return self._outcome(sampling, self.static_step(plan)[[i for i, _ in sampling]])
        batch = PagedBatch(plan, self.rank, self.cache, self.attend, self.combine, self._phases, self.windows, self.paged_index)
        ends = [batch.offsets[i] + len(c.tokens) for i, c in sampling]  # rows: the last known token, then the drafts
        rows = [row for (_, c), end in zip(sampling, ends) for row in range(end - c.num_draft - 1, end)]
        split = token_parallel.splits(batch.tokens.shape[1], self.world_size)
        if split and self.prefill == "ring" and not any(c.decoding for c in plan.chunks):  # rank r runs its zigzag pieces
            hidden = RingPrefillStep(batch, plan.chunks, self.rank, self.world_size, self.comm_group).forward(self.model, rows)
        elif split:  # rank r runs its slice of the tokens
            hidden = token_parallel.TokenParallelStep(batch, self.rank, self.world_size, self.comm_group).forward(self.model, rows)
        else:  # every rank runs every token
            hidden = self.model(batch.tokens, batch.positions, batch.kv_store, batch.attend)[0, rows]
        return self._outcome(sampling, hidden, batch.shared_keys)

    def _outcome(self, sampling: list[tuple[int, Chunk]], hidden: torch.Tensor, shared_keys: int = 0) -> StepOutcome:
        """Rank 0 samples each chunk of `sampling` from `hidden`, the final hidden states of their rows
        (num_draft + 1 per chunk, in order); the other ranks return an empty StepOutcome.
        shared_keys: the step's StepOutcome.shared_prefix_keys."""
        if self.rank != 0 or not sampling:
            return StepOutcome()
        start = time.perf_counter()
        logits = self.model.logits(hidden)
        out, first = StepOutcome(shared_prefix_keys=shared_keys), 0
        for _, c in sampling:
            chunk_logits = logits[first : first + c.num_draft + 1]
            tokens = out.tokens[c.seq_id] = self._sample(c, chunk_logits)
            if tokens is not None and c.sample.logprobs is not None:
                out.logprobs[c.seq_id] = token_logprobs(chunk_logits, tokens, c.sample.logprobs)
            first += c.num_draft + 1
        self._phases["sampling"] = time.perf_counter() - start
        return out

    def _sample(self, chunk: Chunk, logits: torch.Tensor) -> list[int] | None:
        """The new tokens of `chunk` from its logits (num_draft + 1, V) float32: the next token,
        or with drafts the accepted ones and the token after them; None if the logits are not finite.

        Drafts are verified by sampling each position in turn, exactly as decoding without drafts
        would (one draw from the request's generator per token, none when greedy), and keeping
        drafts while they equal the sampled token; the first sampled token that differs from its
        draft, or the one after the last draft, ends the run. For a drafter that proposes one token
        (prompt lookup: all its mass q on the draft x) this is the speculative-sampling rule of
        treeattn.speculate.accept: x is kept with probability p(x) = min(1, p(x) / q(x)), and
        otherwise the token is drawn from p without x, the residual max(0, p - q) normalized. Its
        draws are coupled to decoding's: the same seed gives the same tokens with speculation or
        without, whatever the batch, the prefix cache or the drafts (greedy: the argmax, always).
        """
        from treeattn.engine.config import SamplingParams
        from treeattn.engine.sampling import sample

        spec = chunk.sample
        generator = self._generators.get(chunk.seq_id)
        if generator is None:
            generator = self._generators[chunk.seq_id] = torch.Generator().manual_seed(spec.seed)
        params = SamplingParams(spec.temperature, spec.top_k or None, spec.top_p if spec.top_p < 1 else None)
        if not torch.isfinite(logits).all():  # never an output: the driver fails this request alone
            return None
        drafts = chunk.tokens[len(chunk.tokens) - chunk.num_draft :]
        tokens = []
        for i in range(chunk.num_draft + 1):
            tokens.append(int(sample(logits[i : i + 1], params, generator)[0]))
            if i == chunk.num_draft or tokens[i] != drafts[i]:
                return tokens
