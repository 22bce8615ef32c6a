"""The per-step plan as one list of int32 words: the one encoding that carries it from the driver to every rank.

    message = encode(plan)                        # the driver: the whole plan as int32 words (bytes), encoded once
    wire = PlanWire(device)                       # one per rank; every rank makes the same calls in the same order
    plan = wire.relay(message, group)             # rank 0 of spawned ranks: the driver's words, broadcast as they came
    plan = wire.broadcast(plan, rank, group)      # inside a group: rank 0 packs and broadcasts, the others receive

A plan is a StepPlan (its chunks: tokens, first position, block table, sampling spec, drafts; the
sequences released), KEEPALIVE, a Measure, a SetDecode, a StoreOps (the KV store's block saves and
loads and window checkpoint saves and loads: header kind, length, and the four counts; then per
entry rank or checkpoint id, block index or position, and its 16-byte key as four words), or None (the end).
`encode` writes it as one flat run of int32 words (their bytes, in native order), `decode` reads it back: decode(encode(plan)) ==
plan,
exactly, every field of every SampleSpec included (floats travel as the two words of their float64 bits, a
64-bit seed as two words, a structured output's bitmask as its bytes' words).

    header   kind, length of the ranks' part (words, header included), chunks, released, measure_reset
             (a StepPlan: the whole message's length), window saves, window restores, window drops (a
             SetDecode: kind, length, then the indices of its decode in DECODE_KINDS and of its method in METHODS)
    chunk    seq_id, start, n_tokens, n_blocks, num_draft, n_draft_prefix, has_sample,
             temperature (2 words), top_k, top_p (2 words), seed (2 words), logprobs (-1: None),
             prompt_logprobs (-1: None), n_targets
    then     per chunk: tokens, draft_prefix, targets, its blocks as (rank, index) pairs; then released ids,
             window saves (seq_id, position, checkpoint), restores (seq_id, checkpoint), drops
    rank 0   (past the ranks' part, per chunk that samples) min_p, presence, frequency and repetition
             penalties (2 words each), n_logit_bias, n_prompt_ids, n_output_ids, n_masks (-1: None); then
             the logit bias as (token, 2 words) triples, prompt_ids, output_ids, and per mask its byte
             length and its bytes as words

Rank 0 alone samples: the ranks' part (words[:words[1]]) is what every rank needs to run the step, and
the rest (the sampling fields the other ranks never read: penalties and the tokens they count, the logit
bias, structured outputs' bitmasks) follows it in the same message. The driver encodes the plan once and
sends rank 0 those words (transport.SpawnedRanks); rank 0 broadcasts their leading part as it came and
decodes the whole message for itself, so no rank ever re-encodes a plan, and no bitmask or prompt is
broadcast to ranks that would not read it. The other ranks decode the ranks' part: their SampleSpecs
keep the defaults of the fields past it.

Every word must fit in int32 (token ids, positions, block numbers, sequence ids): a value that does
not raises a ValueError where the plan is encoded, before anything is sent.

The broadcast buffer has a fixed capacity (CAPACITY words at first, 4 KiB) so that the ranks know its size
without a first message: one broadcast per step. A longer plan (a long prefill chunk, many long
block tables) sends its header alone first, then the whole ranks' part in a buffer grown to the next
power of two, which every rank then keeps (they all read the same headers, so they grow together).
The buffer lives on `device`: the CPU for gloo, the rank's CUDA device for NCCL (plan_device).
"""

from __future__ import annotations

import struct
from array import array
from dataclasses import dataclass
from functools import partial
from itertools import chain

import torch
import torch.distributed as dist

from treeattn.cache.blocks import BlockRef
from treeattn.engine.scheduler import Chunk, SampleSpec, StepPlan
from treeattn.engine.structured import StepMasks
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

END, KEEP, MEASURE, STEP, DECODE, STORE, MASKS = range(7)  # header[0]
HEADER = 8
CHUNK_FIELDS = 17
SAMPLE_FIELDS = 12  # rank 0's words of each SampleSpec before its lists
# The fixed parts as structs (native byte order, the buffer's; no padding): the header, a chunk's 17
# words, rank 0's 12 words of a SampleSpec.
_HEADER = struct.Struct("=8i")
_CHUNK = struct.Struct("=7i d i d Q 3i")  # ..., has_sample, temperature, top_k, top_p, seed, logprobs, prompt_logprobs, n_targets
_SAMPLE = struct.Struct("=4d 4i")  # min_p, presence, frequency, repetition; n_bias, n_prompt, n_output, n_masks
_NO_SAMPLE = (0.0, 0, 0.0, 0, 0)
# BlockRef from a (rank, index) pair, without its Python __new__ (decode's hot loop)
_block_ref = partial(tuple.__new__, BlockRef)


def plan_device(group=None) -> torch.device:
    """Where the plan's buffer must be for `group`'s backend: the current CUDA device for NCCL, else the CPU."""
    if dist.is_available() and dist.is_initialized() and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def encode(plan) -> bytearray:
    """The words of `plan` (a StepPlan, KEEPALIVE, a Measure, a SetDecode, a StoreOps or None) as the bytes
    of int32 words in native order; see the module docstring. Floats and seeds are exact. ValueError when
    a value does not fit its word (int32; a seed: 64 bits unsigned).

        >>> words = memoryview(encode(Measure(reset=True))).cast("i")
        >>> words.tolist()        # kind MEASURE, length 8, reset at word 4
        [2, 8, 0, 0, 1, 0, 0, 0]
    """
    try:
        return _encode(plan)
    except (OverflowError, struct.error) as exc:
        raise ValueError(f"the step's plan has a value outside int32 ({exc}): token ids, positions, block numbers "
                         f"and sequence ids must fit") from exc


def _encode(plan) -> bytearray:
    if plan is None:
        return bytearray(_HEADER.pack(END, HEADER, 0, 0, 0, 0, 0, 0))
    if isinstance(plan, str) and plan == KEEPALIVE:
        return bytearray(_HEADER.pack(KEEP, HEADER, 0, 0, 0, 0, 0, 0))
    if isinstance(plan, Measure):
        return bytearray(_HEADER.pack(MEASURE, HEADER, 0, 0, int(plan.reset), 0, 0, 0))
    if isinstance(plan, SetDecode):
        if plan.decode not in DECODE_KINDS or plan.method not in METHODS:
            raise ValueError(f"SetDecode: decode must be one of {DECODE_KINDS} and method one of {METHODS}, "
                             f"got {plan.decode!r} and {plan.method!r}")
        return bytearray(_HEADER.pack(DECODE, HEADER, DECODE_KINDS.index(plan.decode), METHODS.index(plan.method), 0, 0, 0, 0))
    if isinstance(plan, StoreOps):
        entries = (*plan.saves, *plan.loads, *plan.window_saves, *plan.window_loads)
        out = bytearray(_HEADER.pack(STORE, HEADER + 6 * len(entries), len(plan.saves), len(plan.loads),
                                     len(plan.window_saves), len(plan.window_loads), 0, 0))
        for rank, index, key in entries:
            out += struct.pack("=2i", rank, index)
            out += struct.pack("=16s", key)
        return out
    if isinstance(plan, StepMasks):
        return _masks_words(plan)
    if not isinstance(plan, StepPlan):
        raise TypeError(f"plan must be a StepPlan, KEEPALIVE, a Measure, a SetDecode, a StoreOps, a StepMasks or None, "
                        f"got {type(plan).__name__}")
    return _step_words(plan)


def _mask_words(masks) -> bytearray:
    """Bitmasks as words: per mask its byte length, then its bytes padded to whole words."""
    out = bytearray()
    for mask in masks:
        out += struct.pack("=i", len(mask))
        out += mask.ljust(-(-len(mask) // 4) * 4, b"\0")
    return out


def _read_masks(view: memoryview, words: memoryview, at: int, count: int) -> tuple[tuple[bytes, ...], int]:
    """`count` bitmasks that _mask_words wrote at word `at`, and the index past them."""
    masks = []
    for _ in range(count):
        size = words[at]
        masks.append(bytes(view[4 * at + 4 : 4 * at + 4 + size]))
        at += 1 + -(-size // 4)
    return tuple(masks), at


def _masks_words(step: StepMasks) -> bytearray:
    """A StepMasks' words: the header (kind MASKS, length, sequences), then per sequence its id, its
    number of masks and the masks."""
    out = bytearray(4 * HEADER)
    for seq_id, masks in step.masks.items():
        out += struct.pack("=2i", seq_id, len(masks))
        out += _mask_words(masks)
    _HEADER.pack_into(out, 0, MASKS, len(out) // 4, len(step.masks), 0, 0, 0, 0, 0)
    return out


def is_masks(message) -> bool:
    """Whether `message` (encode's bytes) holds a StepMasks rather than a plan.

        >>> is_masks(encode(StepMasks({3: (b"\\x01",)}))), is_masks(encode(KEEPALIVE))
        (True, False)
    """
    return _HEADER.unpack_from(memoryview(message).cast("B"))[0] == MASKS


def _ints(values) -> bytes:
    return array("i", values).tobytes()


def _step_words(plan: StepPlan) -> bytearray:
    """A StepPlan's words: the ranks' part (header, chunk fields, their lists), then rank 0's sampling part."""
    out = bytearray(4 * HEADER)
    for c in plan.chunks:
        s = c.sample
        sample = _NO_SAMPLE if s is None else (s.temperature, s.top_k, s.top_p, s.seed, -1 if s.logprobs is None else s.logprobs)
        out += _CHUNK.pack(c.seq_id, c.start, len(c.tokens), len(c.blocks), c.num_draft, len(c.draft_prefix), s is not None,
                           *sample, -1 if c.prompt_logprobs is None else c.prompt_logprobs, len(c.targets))
    for c in plan.chunks:
        out += _ints(c.tokens)
        out += _ints(c.draft_prefix)
        out += _ints(c.targets)
        out += struct.pack(f"={2 * len(c.blocks)}i", *chain.from_iterable(c.blocks))
    out += _ints(plan.release)
    out += _ints(chain.from_iterable((*plan.window_saves, *plan.window_restores)))
    out += _ints(plan.window_drops)
    shared = len(out) // 4
    for c in plan.chunks:
        if c.sample is not None:
            out += _sample_words(c.sample)
    _HEADER.pack_into(out, 0, STEP, shared, len(plan.chunks), len(plan.release), len(out) // 4, len(plan.window_saves),
                      len(plan.window_restores), len(plan.window_drops))
    return out


def _sample_words(s: SampleSpec) -> bytes:
    """Rank 0's words of one SampleSpec: the fields past logprobs (see the module docstring)."""
    fixed = _SAMPLE.pack(s.min_p, s.presence_penalty, s.frequency_penalty, s.repetition_penalty, len(s.logit_bias),
                         len(s.prompt_ids), len(s.output_ids), -1 if s.allowed is None else len(s.allowed))
    if not (s.logit_bias or s.prompt_ids or s.output_ids or s.allowed):
        return fixed  # no lists (most specs): the fixed words alone
    out = bytearray(fixed)
    out += struct.pack("=" + "id" * len(s.logit_bias), *chain.from_iterable(s.logit_bias))
    out += _ints(s.prompt_ids)
    out += _ints(s.output_ids)
    out += _mask_words(s.allowed or ())
    return out


def pack(plan) -> torch.Tensor:
    """`plan`'s words (encode) as an int32 tensor, the form the broadcast sends; ValueError when a value
    does not fit, before anything is sent.

        >>> decode(pack(Measure(reset=True)).numpy())
        Measure(reset=True)
    """
    return torch.frombuffer(encode(plan), dtype=torch.int32)


def decode(message):
    """The plan that `encode` wrote as `message` (bytes-like: bytes, a bytearray, an int32 array; extra
    words past its length are ignored). A StepPlan cut at its ranks' part (its first words[1] words, what
    the ranks other than 0 receive) decodes with the defaults of the SampleSpec fields past logprobs."""
    view = memoryview(message).cast("B")
    words = view[: len(view) // 4 * 4].cast("i")
    kind, length, *counts = _HEADER.unpack_from(view)
    if kind == END:
        return None
    if kind == KEEP:
        return KEEPALIVE
    if kind == MEASURE:
        return Measure(bool(counts[2]))
    if kind == DECODE:
        return SetDecode(DECODE_KINDS[counts[0]], METHODS[counts[1]])
    if kind == MASKS:
        return _decode_masks(view, words, counts[0])
    if kind == STORE:
        ops = [(words[i], words[i + 1], bytes(view[4 * i + 8 : 4 * i + 24])) for i in range(HEADER, length, 6)]
        cuts = [0, counts[0], counts[0] + counts[1], counts[0] + counts[1] + counts[2], len(ops)]
        return StoreOps(*(tuple(ops[a:b]) for a, b in zip(cuts, cuts[1:])))
    return _decode_step(view, words)


def _decode_masks(view: memoryview, words: memoryview, n_seqs: int) -> StepMasks:
    masks, at = {}, HEADER
    for _ in range(n_seqs):
        seq_id, count = words[at], words[at + 1]
        masks[seq_id], at = _read_masks(view, words, at + 2, count)
    return StepMasks(masks)


def _decode_step(view: memoryview, message: memoryview) -> StepPlan:
    _, shared, n_chunks, n_release, total, n_saves, n_restores, n_drops = _HEADER.unpack_from(view)
    words = message[:shared].tolist()  # the ranks' part as Python ints once: list slices are cheap
    at = HEADER + n_chunks * CHUNK_FIELDS
    whole = len(message) >= total  # rank 0's sampling part is there (not cut at the ranks' part)
    extra = shared
    chunks = []
    for i in range(n_chunks):
        seq_id, start, n_tokens, n_blocks, num_draft, n_prefix, has_sample, *fields, k, n_targets = _CHUNK.unpack_from(
            view, 4 * (HEADER + i * CHUNK_FIELDS))
        tokens = tuple(words[at : at + n_tokens])
        prefix = tuple(words[at + n_tokens : at + n_tokens + n_prefix])
        at += n_tokens + n_prefix
        targets = tuple(words[at : at + n_targets])
        at += n_targets
        pairs = words[at : at + 2 * n_blocks]
        at += 2 * n_blocks
        sample = None
        if has_sample:
            temperature, top_k, top_p, seed, logprobs = fields
            if whole:
                sample, extra = _decode_sample(view, message, extra, (temperature, top_k, top_p, seed,
                                                                      None if logprobs < 0 else logprobs))
            else:
                sample = SampleSpec(temperature, top_k, top_p, seed, None if logprobs < 0 else logprobs)
        chunks.append(Chunk(seq_id, tokens, start, tuple(map(_block_ref, zip(pairs[0::2], pairs[1::2]))), sample, num_draft,
                            prefix,
                            None if k < 0 else k, targets))
    release = tuple(words[at : at + n_release])
    at += n_release
    saves = words[at : at + 3 * n_saves]
    at += 3 * n_saves
    restores = words[at : at + 2 * n_restores]
    at += 2 * n_restores
    return StepPlan(tuple(chunks), release, tuple(zip(saves[0::3], saves[1::3], saves[2::3])),
                    tuple(zip(restores[0::2], restores[1::2])), tuple(words[at : at + n_drops]))


def _decode_sample(view: memoryview, words: memoryview, at: int, head: tuple) -> tuple[SampleSpec, int]:
    """The SampleSpec whose first fields are `head` and the rest what _sample_words wrote at word `at`, and the
    index past them."""
    min_p, presence, frequency, repetition, n_bias, n_prompt, n_output, n_masks = _SAMPLE.unpack_from(view, 4 * at)
    at += SAMPLE_FIELDS
    flat = struct.unpack_from("=" + "id" * n_bias, view, 4 * at)
    at += 3 * n_bias
    prompt_ids = tuple(words[at : at + n_prompt].tolist())
    output_ids = tuple(words[at + n_prompt : at + n_prompt + n_output].tolist())
    at += n_prompt + n_output
    masks = None
    if n_masks >= 0:
        masks, at = _read_masks(view, words, at, n_masks)
    return SampleSpec(*head, min_p, presence, frequency, repetition, tuple(zip(flat[0::2], flat[1::2])), prompt_ids,
                      output_ids, masks), at


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
        """Rank 0's side: pack `plan` and broadcast its ranks' part (its header first when it outgrows the buffer)."""
        self._send_packed(pack(plan), group)

    def relay(self, message, group=None):
        """Rank 0's side when the driver encoded the plan (transport.SpawnedRanks): broadcast the ranks' part of
        `message` (encode's bytes, as the driver sent them) as it came, and return the whole plan decoded (the
        other ranks must be in `receive`).

            >>> PlanWire().relay(encode(Measure(reset=False)))   # no group: nothing to broadcast
            Measure(reset=False)
        """
        if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
            shared = 4 * _HEADER.unpack_from(message)[1]  # the ranks' part, copied into a tensor the broadcast sends
            self._send_packed(torch.frombuffer(bytearray(memoryview(message)[:shared]), dtype=torch.int32), group)
        return decode(message)

    def _send_packed(self, message: torch.Tensor, group=None) -> None:
        message = message[: int(message[1])]  # the ranks' part: rank 0's sampling words stay on rank 0
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
        return decode(host[:length].numpy())

    def _grow(self, length: int) -> None:
        self.buffer = torch.zeros(1 << (length - 1).bit_length(), dtype=torch.int32, device=self.device)
