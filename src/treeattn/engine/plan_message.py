"""The per-step plan as one int32 tensor: how rank 0 sends every step's plan to the other ranks.

    wire = PlanWire(device)                       # one per rank; every rank makes the same calls in the same order
    plan = wire.broadcast(plan, rank, group)      # rank 0's plan on every rank: one broadcast of one int32 buffer

A plan is a StepPlan (its chunks: tokens, first position, block table, sampling spec, drafts; the
sequences released), KEEPALIVE, a Measure, a SetDecode, a StoreOps (the KV store's block saves and
loads and window checkpoint saves and loads: header kind, length, and the four counts; then per
entry rank or checkpoint id, block index or position, and its 16-byte key as four words), or None (the end). `encode` writes it as one flat list of
int32 words, `decode` reads it back: decode(encode(plan)) == plan, exactly (floats travel as the two
words of their float64 bits, a 64-bit seed as two words).

    header   kind, length (words, header included), chunks, released, measure_reset,
             window saves, window restores, window drops (a SetDecode: kind, length, then the
             indices of its decode in DECODE_KINDS and of its method in METHODS)
    chunk    seq_id, start, n_tokens, n_blocks, num_draft, n_draft_prefix, has_sample,
             temperature (2 words), top_k, top_p (2 words), seed (2 words), logprobs (-1: None),
             prompt_logprobs (-1: None), n_targets
    then     per chunk: tokens, draft_prefix, targets, its blocks as (rank, index) pairs; then released ids,
             window saves (seq_id, position, checkpoint), restores (seq_id, checkpoint), drops

Every word must fit in int32 (token ids, positions, block numbers, sequence ids): a value that does
not raises a ValueError naming it, on rank 0, before anything is sent.

The buffer has a fixed capacity (CAPACITY words at first, 4 KiB) so that the ranks know its size
without a first message: one broadcast per step. A longer plan (a long prefill chunk, many long
block tables) sends its header alone first, then the whole message in a buffer grown to the next
power of two, which every rank then keeps (they all read the same headers, so they grow together).
The buffer lives on `device`: the CPU for gloo, the rank's CUDA device for NCCL (plan_device).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import torch
import torch.distributed as dist

from treeattn.cache.blocks import BlockRef
from treeattn.engine.scheduler import Chunk, SampleSpec, StepPlan
from treeattn.models.attention import DECODE_KINDS
from treeattn.parallel.tree_decode import METHODS

# A plan that runs nothing: the idle driver sends one every timeout_s / 4 so that ranks waiting for
# the next plan in a collective never reach the group's timeout.
KEEPALIVE = "keepalive"


@dataclass(frozen=True)
class Measure:
    """A plan that makes every rank report its RankMeasurements (rank 0 answers with all of them)."""

    reset: bool


@dataclass(frozen=True)
class SetDecode:
    """A plan that makes every rank decode from now on with `decode` ("tree" or "ring") and
    tree_decode's `method` (RankRunner.set_decode); its caches stay as they are."""

    decode: str
    method: str


@dataclass(frozen=True)
class StoreOps:
    """A plan that makes every rank save and load its blocks named here to and from its KV store
    (treeattn.engine.kv_tier): saves and loads are (rank, block index, 16-byte key) triples; rank 0
    answers with every rank's StoreReport."""

    saves: tuple[tuple[int, int, bytes], ...] = ()
    loads: tuple[tuple[int, int, bytes], ...] = ()
    window_saves: tuple[tuple[int, int, bytes], ...] = ()  # (checkpoint id, 0, key): rank 0 writes the window checkpoint
    window_loads: tuple[tuple[int, int, bytes], ...] = ()  # (checkpoint id, position, key): every rank reads it


CAPACITY = 1024  # int32 words of the buffer at first

END, KEEP, MEASURE, STEP, DECODE, STORE = range(6)  # header[0]
HEADER = 8
CHUNK_FIELDS = 17


def plan_device(group=None) -> torch.device:
    """Where the plan's buffer must be for `group`'s backend: the current CUDA device for NCCL, else the CPU."""
    if dist.is_available() and dist.is_initialized() and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _float_words(x: float) -> tuple[int, int]:
    return struct.unpack("<ii", struct.pack("<d", x))


def _words_float(lo: int, hi: int) -> float:
    return struct.unpack("<d", struct.pack("<ii", lo, hi))[0]


def _seed_words(seed: int) -> tuple[int, int]:
    return struct.unpack("<ii", struct.pack("<Q", seed))


def _words_seed(lo: int, hi: int) -> int:
    return struct.unpack("<Q", struct.pack("<ii", lo, hi))[0]


def encode(plan) -> list[int]:
    """The words of `plan` (a StepPlan, KEEPALIVE, a Measure, a SetDecode or None); see the module
    docstring. Floats and seeds are exact; the caller checks that every word fits in int32."""
    if plan is None:
        return [END, HEADER, 0, 0, 0, 0, 0, 0]
    if isinstance(plan, str) and plan == KEEPALIVE:
        return [KEEP, HEADER, 0, 0, 0, 0, 0, 0]
    if isinstance(plan, Measure):
        return [MEASURE, HEADER, 0, 0, int(plan.reset), 0, 0, 0]
    if isinstance(plan, SetDecode):
        if plan.decode not in DECODE_KINDS or plan.method not in METHODS:
            raise ValueError(f"SetDecode: decode must be one of {DECODE_KINDS} and method one of {METHODS}, "
                             f"got {plan.decode!r} and {plan.method!r}")
        return [DECODE, HEADER, DECODE_KINDS.index(plan.decode), METHODS.index(plan.method), 0, 0, 0, 0]
    if isinstance(plan, StoreOps):
        words = [STORE, 0, len(plan.saves), len(plan.loads), len(plan.window_saves), len(plan.window_loads), 0, 0]
        for rank, index, key in (*plan.saves, *plan.loads, *plan.window_saves, *plan.window_loads):
            words += (rank, index, *struct.unpack("<4i", key))
        words[1] = len(words)
        return words
    if not isinstance(plan, StepPlan):
        raise TypeError(f"plan must be a StepPlan, KEEPALIVE, a Measure, a SetDecode, a StoreOps or None, got {type(plan).__name__}")
    words = [STEP, 0, len(plan.chunks), len(plan.release), 0, len(plan.window_saves), len(plan.window_restores),
             len(plan.window_drops)]
    for c in plan.chunks:
        s = c.sample
        words += (c.seq_id, c.start, len(c.tokens), len(c.blocks), c.num_draft, len(c.draft_prefix), s is not None)
        if s is None:
            words += (0,) * 8
        else:
            words += (*_float_words(s.temperature), s.top_k, *_float_words(s.top_p), *_seed_words(s.seed),
                      -1 if s.logprobs is None else s.logprobs)
        words += (-1 if c.prompt_logprobs is None else c.prompt_logprobs, len(c.targets))
    for c in plan.chunks:
        words += c.tokens
        words += c.draft_prefix
        words += c.targets
        for block in c.blocks:
            words += block
    words += plan.release
    for entry in (*plan.window_saves, *plan.window_restores):
        words += entry
    words += plan.window_drops
    words[1] = len(words)
    return words


def pack(plan) -> torch.Tensor:
    """`plan`'s words (encode) as the one int32 tensor that carries it from rank 0 to the other ranks (a
    broadcast). ValueError when a word does not fit in
    int32, before anything is sent.

        >>> decode(pack(Measure(reset=True)).tolist())
        Measure(reset=True)
    """
    words = encode(plan)
    try:
        return torch.tensor(words, dtype=torch.int32)
    except RuntimeError as exc:  # a word past int32
        raise ValueError(f"the step's plan has a value outside int32 (largest {max(words)}, smallest {min(words)}): "
                         f"token ids, positions, block numbers and sequence ids must fit") from exc


def decode(words: list[int]):
    """The plan that `encode` wrote as `words` (extra words past its length are ignored)."""
    kind = words[0]
    if kind == END:
        return None
    if kind == KEEP:
        return KEEPALIVE
    if kind == MEASURE:
        return Measure(bool(words[4]))
    if kind == DECODE:
        return SetDecode(DECODE_KINDS[words[2]], METHODS[words[3]])
    if kind == STORE:
        ops = [(words[i], words[i + 1], struct.pack("<4i", *words[i + 2 : i + 6])) for i in range(HEADER, words[1], 6)]
        cuts = [0, words[2], words[2] + words[3], words[2] + words[3] + words[4], len(ops)]
        return StoreOps(*(tuple(ops[a:b]) for a, b in zip(cuts, cuts[1:])))
    n_chunks, n_release, n_saves, n_restores, n_drops = words[2], words[3], words[5], words[6], words[7]
    fields = [words[HEADER + i * CHUNK_FIELDS : HEADER + (i + 1) * CHUNK_FIELDS] for i in range(n_chunks)]
    at = HEADER + n_chunks * CHUNK_FIELDS
    chunks = []
    for seq_id, start, n_tokens, n_blocks, num_draft, n_prefix, has_sample, t0, t1, top_k, p0, p1, s0, s1, logprobs, k, n_targets in fields:
        tokens = tuple(words[at : at + n_tokens])
        at += n_tokens
        prefix = tuple(words[at : at + n_prefix])
        at += n_prefix
        targets = tuple(words[at : at + n_targets])
        at += n_targets
        pairs = words[at : at + 2 * n_blocks]
        at += 2 * n_blocks
        sample = (SampleSpec(_words_float(t0, t1), top_k, _words_float(p0, p1), _words_seed(s0, s1),
                             None if logprobs < 0 else logprobs) if has_sample else None)
        chunks.append(Chunk(seq_id, tokens, start, tuple(map(BlockRef, pairs[0::2], pairs[1::2])), sample, num_draft, prefix,
                            None if k < 0 else k, targets))
    release = tuple(words[at : at + n_release])
    at += n_release
    saves = tuple(tuple(words[i : i + 3]) for i in range(at, at + 3 * n_saves, 3))
    at += 3 * n_saves
    restores = tuple(tuple(words[i : i + 2]) for i in range(at, at + 2 * n_restores, 2))
    at += 2 * n_restores
    return StepPlan(tuple(chunks), release, saves, restores, tuple(words[at : at + n_drops]))


class PlanWire:
    """One rank's end of the plan broadcast (see the module docstring).

    Args:
        device: where the buffer lives: plan_device(group) (the CPU for gloo, CUDA for NCCL).
    """

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self.buffer = torch.zeros(CAPACITY, dtype=torch.int32, device=self.device)

    def broadcast(self, plan, rank: int, group=None):
        """Rank 0's `plan` on every rank of `group` (`rank`: this process's rank in the group; the
        others pass anything as `plan`). Every rank of the group must call it, in the same order."""
        if not (dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1):
            return plan
        if rank == 0:
            self.send(plan, group)
            return plan
        return self.receive(group)

    def send(self, plan, group=None) -> None:
        """Rank 0's side: encode `plan` and broadcast it (its header first when it outgrows the buffer)."""
        self._send_packed(pack(plan), group)

    def _send_packed(self, message: torch.Tensor, group=None) -> None:
        src = 0 if group is None else dist.get_global_rank(group, 0)
        if message.numel() > self.buffer.numel():
            self.buffer[:HEADER].copy_(message[:HEADER])
            dist.broadcast(self.buffer, src=src, group=group)
            self._grow(message.numel())
        self.buffer[: message.numel()].copy_(message)
        dist.broadcast(self.buffer, src=src, group=group)

    def receive(self, group=None):
        """The other ranks' side: the plan rank 0 sent (growing the buffer as its header says)."""
        src = 0 if group is None else dist.get_global_rank(group, 0)
        dist.broadcast(self.buffer, src=src, group=group)
        host = self.buffer.cpu()  # one copy to the host (none on the CPU)
        length = int(host[1])
        if length > host.numel():
            self._grow(length)
            dist.broadcast(self.buffer, src=src, group=group)
            host = self.buffer.cpu()
        return decode(host[:length].tolist())

    def _grow(self, length: int) -> None:
        self.buffer = torch.zeros(1 << (length - 1).bit_length(), dtype=torch.int32, device=self.device)
