"""The engine's static decode step: fixed shapes, no host synchronization, capturable in a CUDA graph.

A dynamic engine step (treeattn.engine.worker.batch.PagedBatch) builds its index tensors on the host from
the step's plan, with shapes that follow the batch and the sequences' lengths, and attention picks
its path from the data: on a GPU each step waits on the device many times and cannot be captured.
A step whose chunks all run one token each (decoding without drafts) can instead run over fixed
buffers, the way vLLM runs its decode steps in CUDA graphs. Its shape is a StaticShape:

    batch   B   sequences, the plan's count rounded up to a bucket (1, 2, 4, ..., max_batch_size)
    blocks  NB  table width: the most blocks any one rank holds of any one sequence, rounded up to
                1, 2, 3, 4, 6, 8, 12, 16, 24, ... (at most blocks_per_rank); the same on every rank

and every input lives in one int64 device buffer that the host fills with ONE copy per step:

    tokens     (B, 1)   the new token of each sequence (0 in padding rows)
    positions  (B, 1)   its position (-1 in padding rows: that query sees nothing)
    slots      (B,)     flat arena slot (block * block_size + offset) of the new token on this rank;
                        a rank that does not hold the token's block writes zeros into the pad block
    owned      (B,)     1 where this rank holds the new token's block, else 0
    fresh      (B,)     the block the token starts (its first slot), to be zeroed; else the pad block
    table      (B, NB)  this rank's blocks of each sequence in logical order, then cache.pad_block
    logical    (B, NB)  their logical block numbers, -1 for padding

Inside the step everything is device work of fixed shape: keys' positions come from `logical`
(INVISIBLE_POSITION past the sequence's end and in pad blocks), and attention reads this rank's
blocks in one of two ways:

- gathered (the CPU; ring decoding, which passes the shard itself): the blocks are copied from the
  arena through `table` into (B, NB * block_size, Hkv, D), and attention is the graph-safe back end
  (models.attention.attention_backend(graph_safe=True): graph_safe_attention, tree_decode /
  ring_decode with check_inputs=False);
- paged (CUDA, tree and local decoding): the Triton paged decode kernel reads the blocks in place
  through the table (ops.triton_decode.paged_decode_attention, as vLLM's paged attention does), and
  combine_states merges the ranks' states; nothing is copied.

Either way only the first kv_len keys of a row are read on CUDA: the valid keys of a row are a
prefix of its table's slots (every local block but the sequence's last is full). Padding rows see no
key (out 0) and are never sampled.

With graph=True (CUDA only) each StaticShape is captured in a CUDA graph at its first use, after
warmup on a side stream (Triton compiles, NCCL connects, cuBLAS picks its kernels); later steps of that shape copy their inputs
in and replay it. The warmup runs the real step (it rewrites the same keys/values), so nothing is
put back. All graphs share one memory pool; their inputs and outputs are buffers allocated before
capture.

The cost of fixed shapes: attention reads B * NB * block_size slots per rank (the gather copies them
all; on the CPU graph_safe_attention also attends to all of them), up to twice the dynamic step's
keys, and padding rows run the whole model.

    step = StaticDecodeStep(model, cache, rank=rank, max_batch_size=16, decode="tree", group=group, graph=False)
    if step.takes(plan):      # RankRunner.step does this
        hidden = step(plan)   # (len(plan.chunks), hidden_size): row i is chunk i's final hidden state
"""

from __future__ import annotations

import logging
from typing import NamedTuple

import torch
import torch.distributed as dist

from treeattn.cache.blocks import tokens_to_blocks
from treeattn.cache.paged import PagedKVCache
from treeattn.cache.sharded import INVISIBLE_POSITION
from treeattn.engine.scheduler import StepPlan
from treeattn.models.attention import attention_backend, group_world_size
from treeattn.models.llama import LlamaModel
from treeattn.ops.attention import _triton_decode_module
from treeattn.ops.fp8 import FP8
from treeattn.parallel import Topology, comm
from treeattn.parallel.tree_decode import combine_states

logger = logging.getLogger(__name__)




def graph_safe_reason(model: LlamaModel, batch_size: int = 1) -> str | None:
    """Why the static decode step (StaticDecodeStep) cannot run `model` on its device without host synchronization, or None.

    Off CUDA the step always runs (graph_safe_attention's dense path). On CUDA the Triton decode
    kernel must take the model's attention: triton installed, float16/bfloat16/float32, a head dim
    that is a power of two from 16 to 256.
    """
    if not isinstance(model, LlamaModel):
        return f"the static step runs LlamaModel only, not {type(model).__name__}"
    if model.device.type != "cuda":
        return None
    from treeattn.ops.attention import _triton_decode_module

    triton_decode = _triton_decode_module()
    if triton_decode is None:
        return "triton is not installed (pip install 'treeattn[triton]'), so the Triton decode kernel is unavailable"
    c = model.config
    q = torch.empty(batch_size, 1, c.num_heads, c.head_dim, dtype=model.dtype, device=model.device)
    kv = torch.empty(batch_size, 1, c.num_kv_heads, c.head_dim, dtype=model.dtype, device=model.device)
    reason = triton_decode.unsupported_reason(q, kv, kv)
    return None if reason is None else f"the Triton decode kernel does not take {reason}"


def batch_buckets(max_batch_size: int) -> tuple[int, ...]:
    """The batch sizes a static step runs: powers of two below max_batch_size, then max_batch_size."""
    buckets, b = [], 1
    while b < max_batch_size:
        buckets.append(b)
        b *= 2
    return (*buckets, max_batch_size)


def _round_up(n: int, buckets: tuple[int, ...]) -> int:
    return next(b for b in buckets if b >= n)


def width_bucket(n: int, cap: int) -> int:
    """The table width for `n` blocks: the smallest of 1, 2, 3, 4, 6, 8, 12, 16, 24, ... (2^k and
    1.5 * 2^k: at most a third more blocks than needed, and few shapes) that is >= n, at most max(n, cap)."""
    bits = n.bit_length()
    width = min(w for w in {1 << k for k in range(bits + 1)} | {3 << k for k in range(bits)} if w >= n)
    return min(width, max(n, cap))


class StaticShape(NamedTuple):
    """The shape of one static step: `batch` rows, `blocks` table entries per row (see the module doc)."""

    batch: int
    blocks: int


class _Buffers:
    """The fixed device buffers of one StaticShape, the attention back end reading them, and the
    shape's CUDA graph once captured."""

    def __init__(self, shape: StaticShape, block_size: int, world_size: int, model: LlamaModel, attend_args: dict,
                 kernel) -> None:
        B, NB = shape
        device = model.device
        self.shape = shape
        self.inputs = torch.zeros(5 * B + 2 * B * NB, dtype=torch.int64, device=device)  # the one host-to-device copy
        parts = self.inputs.split([B, B, B, B, B, B * NB, B * NB])
        self.tokens, self.positions = parts[0].view(B, 1), parts[1].view(B, 1)
        self.slots, self.owned, self.fresh = parts[2], parts[3], parts[4]
        self.table, self.logical = parts[5].view(B, NB), parts[6].view(B, NB)
        self.offsets = torch.arange(block_size, dtype=torch.int64, device=device)
        self.kv_pos = torch.full((B, NB * block_size), INVISIBLE_POSITION, dtype=torch.int64, device=device)
        self.kv_len = torch.zeros(B, dtype=torch.int64, device=device)
        self.hidden = torch.zeros(B, model.config.hidden_size, dtype=model.dtype, device=device)
        self.table32 = torch.zeros(B, NB, dtype=torch.int32, device=device) if kernel is not None else None
        if kernel is not None:
            self.attend = PagedKernelAttention(kernel, self.table32, self.kv_len, world_size=world_size, **attend_args)
        else:  # every rank's gathered shard has NB * block_size slots (the ring needs them, so as not to gather them)
            self.attend = attention_backend(graph_safe=True, kv_len=self.kv_len, shard_lengths=[NB * block_size] * world_size,
                                            **attend_args)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.step_comm: comm.CommStats | None = None  # one captured step's traffic


class PagedKernelAttention:
    """The static step's attention read in place: the Triton paged decode kernel over this rank's
    blocks through the step's table (k, v are the arena's block pools), then combine_states across
    the ranks. No host synchronization.

    Args:
        kernel: the treeattn.ops.triton_decode module (tests pass it loaded under Triton's interpreter).
        table: int32 (B, NB) the step's block table; kv_len: int64 (B,) valid keys per row (buffers
            the step fills before every call).
        world_size, decode, method, group, topology: the combine across the ranks.
    """

    def __init__(self, kernel, table: torch.Tensor, kv_len: torch.Tensor, *, world_size: int, decode: str, method: str,
                 group: dist.ProcessGroup | None, topology=None) -> None:
        if decode == "ring" and world_size > 1:
            raise ValueError("the paged read combines states (tree decoding); ring decoding passes the gathered shard")
        self.kernel, self.table, self.kv_len = kernel, table, kv_len
        self.world_size, self.method, self.group = world_size, method, group
        self.scales = (None, None)  # an fp8 cache's scales of the layer being run (PagedKVCache.block_scales), set by kv_store
        self.ranks_per_node = (topology or Topology()).resolve(world_size) if method == "twolevel" else 1

    def __call__(self, q, k, v, *, q_pos, kv_pos, window):
        """q (B, 1, Hq, D); k, v (num_blocks + 1, block_size, Hkv, D) pools (fp8: codes, with
        self.scales); kv_pos int64 (B, NB * block_size) -> out (B, 1, Hq, D) in q.dtype."""
        k_scales, v_scales = self.scales
        out, lse = self.kernel.paged_decode_attention(q, k, v, self.table, self.kv_len, causal=True, q_pos=q_pos, kv_pos=kv_pos,
                                                      window=window, k_scales=k_scales, v_scales=v_scales)
        if self.world_size > 1:
            out, lse = combine_states(out.float(), lse, group=self.group, method=self.method, ranks_per_node=self.ranks_per_node)
        return out.to(q.dtype)


class StaticDecodeStep:
    """The engine's static decode step on one rank (see the module docstring).

    Args:
        model: the LlamaModel (the same weights on every rank).
        cache: this rank's PagedKVCache.
        rank: this rank in `group`.
        max_batch_size: the engine's; the largest batch bucket.
        decode: "tree", "ring" or "local": the graph-safe attention's kind (attention_backend).
        method: tree_decode's combine: "allreduce", "tree" or "twolevel" (not "onepass": it reads
            the host; treeattn.engine.config.resolve_method refuses it first).
        group: the process group the attention combines over (None: the world).
        topology: for method "twolevel".
        graph: replay each shape from a CUDA graph (the model must be on a CUDA device).
        kernel: the Triton decode module for the paged read (see the module docstring); None: on
            CUDA (tree and local decoding) treeattn.ops.triton_decode, else the gathered read.

    Raises:
        ValueError: graph on a model off CUDA, or a model the graph-safe attention cannot take
            (graph_safe_reason).
    """

    def __init__(self, model: LlamaModel, cache: PagedKVCache, *, rank: int, max_batch_size: int, decode: str,
                 method: str = "allreduce", group: dist.ProcessGroup | None = None, topology=None, graph: bool = False,
                 kernel=None) -> None:
        if graph and model.device.type != "cuda":
            raise ValueError(f"decode_step='graph' records CUDA graphs: the model must be on a CUDA device, got {model.device}")
        reason = graph_safe_reason(model, max_batch_size)
        if reason is not None:
            raise ValueError(f"the static decode step cannot run this model on {model.device}: {reason}")
        self.model, self.cache, self.rank, self.use_graphs = model, cache, rank, graph
        self.world_size = group_world_size(group)
        self.buckets = batch_buckets(max_batch_size)
        self._attend_args = dict(decode=decode, method=method, group=group, topology=topology)
        ring = decode == "ring" and self.world_size > 1
        if kernel is None and model.device.type == "cuda" and not ring:
            kernel = _triton_decode_module()  # graph_safe_reason found it
        # The Triton kernel reads blocks of the queries' dtype or fp8 blocks with their scales: a cache
        # stored in another dtype (a 16-bit kv_cache_dtype under a float32 model) is gathered, in the model's.
        self.kernel = None if ring or cache.dtype not in (model.dtype, FP8) else kernel
        self._buffers: dict[StaticShape, _Buffers] = {}
        self._pool = None  # the memory pool every captured graph shares
        self.steps = 0  # static steps run (tests and benchmarks read it)

    @staticmethod
    def takes(plan: StepPlan) -> bool:
        """Whether `plan` is a static step: every chunk runs exactly one token (no drafts, no longer prompt chunk)."""
        return bool(plan.chunks) and all(len(c.tokens) == 1 and c.num_draft == 0 and not c.draft_prefix for c in plan.chunks)

    @property
    def shapes(self) -> list[StaticShape]:
        """The shapes run so far, in the order of their first use."""
        return list(self._buffers)

    def shape_of(self, plan: StepPlan) -> StaticShape:
        """The StaticShape of `plan`: the same on every rank (it depends on the plan alone)."""
        bs, p = self.cache.block_size, self.world_size
        most = 1
        for c in plan.chunks:
            held = [0] * p
            for ref in c.blocks[: tokens_to_blocks(c.start + 1, bs)]:
                held[ref.rank] += 1
            most = max(most, *held)
        return StaticShape(_round_up(len(plan.chunks), self.buckets), width_bucket(most, self.cache.num_blocks))

    def __call__(self, plan: StepPlan) -> torch.Tensor:
        """Run `plan` (takes(plan) must hold). Returns hidden (len(plan.chunks), hidden_size) in the
        model dtype, row i for chunk i: a view of a buffer the next step of this shape overwrites."""
        shape = self.shape_of(plan)
        buffers = self._buffers.get(shape)
        if buffers is None:
            buffers = self._buffers[shape] = _Buffers(shape, self.cache.block_size, self.world_size, self.model,
                                                      self._attend_args,
                                                      self.kernel)
        buffers.inputs.copy_(self._host_inputs(plan, shape))
        if self.use_graphs and buffers.graph is None:
            self._capture(buffers)
        if buffers.graph is not None:
            buffers.graph.replay()
            comm.record_replay(buffers.step_comm)
        else:
            self._run(buffers)
        self.steps += 1
        return buffers.hidden[: len(plan.chunks)]

    def _host_inputs(self, plan: StepPlan, shape: StaticShape) -> torch.Tensor:
        """The step's inputs in the layout of _Buffers.inputs: int64 (5 B + 2 B NB,) on the host."""
        B, NB = shape
        bs, pad = self.cache.block_size, self.cache.pad_block
        tokens, positions = [0] * B, [-1] * B
        slots, owned, fresh = [pad * bs] * B, [0] * B, [pad] * B
        table, logical = [[pad] * NB for _ in range(B)], [[-1] * NB for _ in range(B)]
        for b, c in enumerate(plan.chunks):
            pos = c.start
            tokens[b], positions[b] = c.tokens[0], pos
            ref = c.blocks[pos // bs]
            if ref.rank == self.rank:
                slots[b], owned[b] = ref.index * bs + pos % bs, 1
                if pos % bs == 0:  # the token starts this block: zero its stale slots first
                    fresh[b] = ref.index
            i = 0
            for j, r in enumerate(c.blocks[: pos // bs + 1]):
                if r.rank == self.rank:
                    table[b][i], logical[b][i] = r.index, j
                    i += 1
        flat = (
            tokens + positions + slots + owned + fresh + [x for row in table for x in row] + [x for row in logical for x in row]
        )
        return torch.tensor(flat, dtype=torch.int64)

    def _run(self, buffers: _Buffers) -> None:
        """The step itself: device work only, every shape fixed, no host read of a device value."""
        cache, bs = self.cache, self.cache.block_size
        cache.zero_blocks(buffers.fresh)  # zeroing the pad block (the padding entries) changes nothing
        pos = (buffers.logical[:, :, None] * bs + buffers.offsets).flatten(1)  # (B, NB * bs) every slot's position
        visible = (buffers.logical >= 0)[:, :, None].expand(-1, -1, bs).flatten(1) & (pos <= buffers.positions)
        buffers.kv_pos.copy_(torch.where(visible, pos, INVISIBLE_POSITION))
        buffers.kv_len.copy_(visible.sum(dim=1))  # the visible keys are a prefix of each row

        owned = (buffers.owned != 0).view(-1, 1, 1)
        if buffers.table32 is not None:
            buffers.table32.copy_(buffers.table)

        def kv_store(layer: int, k_new: torch.Tensor, v_new: torch.Tensor):
            """Write this rank's new keys/values (zeros into the pad block for the others); return the
            gathered shard k, v (B, NB * bs, Hkv, D) (the paged read: the block pools, (num_blocks + 1,
            bs, Hkv, D)) and kv_pos int64 (B, NB * bs)."""
            k_new, v_new = k_new[:, 0], v_new[:, 0]
            cache.write(layer, buffers.slots, torch.where(owned, k_new, 0), torch.where(owned, v_new, 0))
            if buffers.table32 is None:
                k, v = cache.gather(layer, buffers.table)
            else:
                k, v = cache.blocks(layer)
                buffers.attend.scales = cache.block_scales(layer)
            return k, v, buffers.kv_pos

        hidden = self.model(buffers.tokens, buffers.positions, kv_store, buffers.attend)
        buffers.hidden.copy_(hidden[:, -1])

    def _capture(self, buffers: _Buffers, warmup: int = 2) -> None:
        """Record buffers' step in a CUDA graph (every rank together: the plan is the same on every
        rank, so every rank captures the same shape at the same step)."""
        with comm.separate_comm_stats():
            side = torch.cuda.Stream(device=buffers.hidden.device)
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(warmup):  # Triton compiles, cuBLAS picks its kernels; rewrites the same values
                    self._run(buffers)
            torch.cuda.current_stream().wait_stream(side)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with comm.separate_comm_stats() as captured:
                with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
                    self._run(buffers)
        self._pool = self._pool or graph.pool()
        buffers.graph, buffers.step_comm = graph, captured
        logger.info("static decode step %s captured in a CUDA graph", tuple(buffers.shape))
