"""Instrumented communication: every collective and point-to-point op treeattn issues, and its accounting.

All of treeattn.parallel talks to torch.distributed only through the wrappers here, so that
``comm_stats()`` can record, for this rank, what each call put on the wire. Ops issued by other
code (your own ``dist.all_reduce``) are not recorded.

    with ta.comm_stats() as stats:
        out, lse = ta.tree_decode(q, k, v)
    stats.bytes_sent, stats.messages, stats.rounds   # totals for this rank
    stats.by_op["allreduce"].bytes_sent               # per op: allreduce, allgather, broadcast, p2p

How each op is counted (per rank, per call; n = bytes of the tensor this rank hands to the op):

    op          payload_bytes  bytes_sent                 bytes_received             messages      rounds
    allreduce   n              2 (p-1)/p * n              2 (p-1)/p * n              1             1
    allgather   n (own piece)  (p-1) * n                  sum of the other pieces    1             1
    broadcast   n              n on the source, else 0    n off the source, else 0   1             1
    p2p         bytes sent     bytes of every send        bytes of every recv        sends posted  1 per step

- allreduce: bytes_sent is the volume of a bandwidth-optimal allreduce (reduce-scatter then
  all-gather, ring or tree): 2 (p-1)/p times the payload, the convention of the paper's eq. 12.
  So the tree decode's two allreduces together send 2 (p-1)/p * (b*d + 2*b*Hq) * itemsize bytes,
  the paper's eq. 14. The payload is recorded too (payload_bytes), for other conventions.
- allgather: each rank's piece must reach p-1 others: (p-1) * n.
- broadcast: the source sends the tensor once; forwarding inside the backend is not counted.
- p2p: exact bytes. One *step* (a call to ``exchange``: sends and receives posted together and
  waited on together) is one round; ``messages`` counts the sends.
- A collective over a group of one rank moves nothing and is neither issued nor recorded.

``rounds`` counts sequential communication steps on this rank: each collective is one round
(whatever the backend does inside it), each p2p step is one round. ``calls`` counts wrapper calls.

CUDA graphs: the wrappers record when they are called, which for a captured step is capture time
only; a replay issues the same collectives without passing through Python. A captured step
therefore records its traffic once, inside ``separate_comm_stats()`` (so that warmup and capture
do not count as traffic of any enclosing block), and adds it with ``record_replay(stats)`` at each
replay (treeattn.engine.worker.static_step.StaticDecodeStep does both).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from treeattn.parallel.shared_memory import SharedMemoryGroup

OP_NAMES = ("allreduce", "allgather", "broadcast", "p2p")


@dataclass
class OpStats:
    """Counters for one kind of op on this rank (see the module docstring for the conventions)."""

    calls: int = 0
    messages: int = 0
    rounds: int = 0
    payload_bytes: int = 0
    bytes_sent: float = 0.0
    bytes_received: float = 0.0


@dataclass
class CommStats:
    """What this rank communicated inside a ``comm_stats()`` block: totals and ``by_op[name]``."""

    by_op: dict[str, OpStats] = field(default_factory=lambda: {name: OpStats() for name in OP_NAMES})

    @property
    def bytes_sent(self) -> float:
        return sum(op.bytes_sent for op in self.by_op.values())

    @property
    def bytes_received(self) -> float:
        return sum(op.bytes_received for op in self.by_op.values())

    @property
    def messages(self) -> int:
        return sum(op.messages for op in self.by_op.values())

    @property
    def rounds(self) -> int:
        return sum(op.rounds for op in self.by_op.values())

    @property
    def calls(self) -> int:
        return sum(op.calls for op in self.by_op.values())

    def add(self, other: "CommStats") -> None:
        """Add every counter of `other` to this one's."""
        for name, op in other.by_op.items():
            entry = self.by_op[name]
            for counter, value in vars(op).items():
                setattr(entry, counter, getattr(entry, counter) + value)

    def as_dict(self) -> dict:
        """Plain-dict copy (picklable, JSON-friendly): totals and per-op counters."""
        return {
            "bytes_sent": self.bytes_sent,
            "bytes_received": self.bytes_received,
            "messages": self.messages,
            "rounds": self.rounds,
            "calls": self.calls,
            "by_op": {name: dict(vars(op)) for name, op in self.by_op.items()},
        }


_ACTIVE: contextvars.ContextVar[tuple[CommStats, ...]] = contextvars.ContextVar("treeattn_comm_stats", default=())


@contextlib.contextmanager
def comm_stats() -> Iterator[CommStats]:
    """Record every op treeattn issues on this rank inside the block. Blocks may nest; each
    records everything issued while it is open.

    Example (on every rank of a group: what this rank sent inside the block)::

        >>> import torch, treeattn as ta
        >>> q = torch.randn(1, 1, 8, 64, generator=torch.Generator().manual_seed(0))   # the same q on every rank
        >>> k, v = torch.randn(2, 1, 100, 2, 64)                       # this rank's shard (any values)
        >>> with ta.comm_stats() as stats:
        ...     out, lse = ta.tree_decode(q, k, v, method="allreduce")
        >>> stats.by_op["allreduce"].calls, stats.bytes_sent > 0      # Algorithm 3: an allreduce of max, one of sums
        (2, True)
    """
    stats = CommStats()
    token = _ACTIVE.set(_ACTIVE.get() + (stats,))
    try:
        yield stats
    finally:
        _ACTIVE.reset(token)


@contextlib.contextmanager
def separate_comm_stats() -> Iterator[CommStats]:
    """Like comm_stats(), but what is issued inside the block is recorded only in this block, not in
    the blocks around it (e.g. the warmup and capture of a CUDA graph)."""
    stats = CommStats()
    token = _ACTIVE.set((stats,))
    try:
        yield stats
    finally:
        _ACTIVE.reset(token)


def record_replay(stats: CommStats) -> None:
    """Add `stats` (what one captured step issued, recorded at capture) to every open comm_stats
    block: one call per replay of the CUDA graph."""
    for active in _ACTIVE.get():
        active.add(stats)


def _record(op: str, *, payload: int = 0, sent: float = 0.0, received: float = 0.0, messages: int = 1) -> None:
    for stats in _ACTIVE.get():
        entry = stats.by_op[op]
        entry.calls += 1
        entry.messages += messages
        entry.rounds += 1
        entry.payload_bytes += payload
        entry.bytes_sent += sent
        entry.bytes_received += received


# ------------------------------------------------------------------------------------ groups


def process_group(group) -> dist.ProcessGroup | None:
    """The torch.distributed group behind `group` (a SharedMemoryGroup wraps one)."""
    return group.process_group if isinstance(group, SharedMemoryGroup) else group


def group_size(group: dist.ProcessGroup | None) -> int:
    """Number of ranks in `group` (None: the default world group)."""
    if isinstance(group, SharedMemoryGroup):  # known without asking torch.distributed (a decode step asks per layer)
        return group.size
    return dist.get_world_size(process_group(group))


def group_rank(group: dist.ProcessGroup | None) -> int:
    """This process's rank inside `group`."""
    return dist.get_rank(process_group(group))


def global_rank(group: dist.ProcessGroup | None, rank_in_group: int) -> int:
    """The world rank of `rank_in_group` (send/recv address peers by world rank)."""
    group = process_group(group)
    if group is None or group is dist.GroupMember.WORLD:
        return rank_in_group
    return dist.get_global_rank(group, rank_in_group)


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


# ------------------------------------------------------------------------------- collectives


def all_reduce(tensor: torch.Tensor, op: dist.ReduceOp, group: dist.ProcessGroup | None) -> torch.Tensor:
    """In-place allreduce of a contiguous tensor over `group`; returns it."""
    p = group_size(group)
    if p == 1:
        return tensor
    _require_contiguous("all_reduce", tensor)
    n = nbytes(tensor)
    _record("allreduce", payload=n, sent=2 * (p - 1) / p * n, received=2 * (p - 1) / p * n)
    if isinstance(group, SharedMemoryGroup) and group.fits(tensor, op):
        return group.all_reduce(tensor, op)
    dist.all_reduce(tensor, op=op, group=process_group(group))
    return tensor


def all_gather(tensor: torch.Tensor, group: dist.ProcessGroup | None) -> list[torch.Tensor]:
    """Gather an equal-shaped tensor from every rank of `group`; returns the list in rank order."""
    p = group_size(group)
    if p == 1:
        return [tensor]
    _require_contiguous("all_gather", tensor)
    pieces = [torch.empty_like(tensor, memory_format=torch.contiguous_format) for _ in range(p)]
    n = nbytes(tensor)
    _record("allgather", payload=n, sent=(p - 1) * n, received=(p - 1) * n)
    if isinstance(group, SharedMemoryGroup) and group.fits(tensor):
        return group.all_gather(tensor)
    dist.all_gather(pieces, tensor, group=process_group(group))
    return pieces


def broadcast(tensor: torch.Tensor, src: int, group: dist.ProcessGroup | None) -> torch.Tensor:
    """In-place broadcast from group rank `src` to every rank of `group`; returns the tensor."""
    p = group_size(group)
    if p == 1:
        return tensor
    _require_contiguous("broadcast", tensor)
    n = nbytes(tensor)
    is_src = group_rank(group) == src
    _record("broadcast", payload=n, sent=n if is_src else 0, received=0 if is_src else n)
    if isinstance(group, SharedMemoryGroup) and group.fits(tensor):
        return group.broadcast(tensor, src)
    dist.broadcast(tensor, src=global_rank(group, src), group=process_group(group))
    return tensor


def _require_contiguous(op: str, tensor: torch.Tensor) -> None:
    """Backends reduce the raw storage: a strided tensor whose layout differs between ranks
    would combine mismatched elements, silently. Refuse it."""
    if not tensor.is_contiguous():
        raise ValueError(f"{op}: tensor must be contiguous, got strides {tensor.stride()} for shape {tuple(tensor.shape)}")


# ------------------------------------------------------------------------------------- p2p


class Step:
    """The pending sends and receives of one p2p step; ``wait()`` completes them all."""

    def __init__(self, works: list) -> None:
        self._works = works

    def wait(self) -> None:
        for work in self._works:
            work.wait()
        self._works = []


def exchange(
    sends: Sequence[tuple[torch.Tensor, int]],
    recvs: Sequence[tuple[torch.Tensor, int]],
    group: dist.ProcessGroup | None,
) -> Step:
    """Post one p2p step: ``sends`` are (tensor, dst group rank), ``recvs`` (buffer, src group rank).

    Everything is posted at once (non-blocking) and returned as a Step to ``wait()`` on, so the
    caller can compute while the transfer runs. Messages between one pair of ranks in one step
    are matched in the order given (tag = position in the list), so both sides must list them in
    the same order. Empty tensors are not sent. Tensors must be contiguous.
    """
    sends = [(t, peer) for t, peer in sends if t.numel() > 0]
    recvs = [(t, peer) for t, peer in recvs if t.numel() > 0]
    if not sends and not recvs:
        return Step([])
    ops = []
    tags: dict[tuple[str, int], int] = {}
    for kind, items, fn in (("send", sends, dist.isend), ("recv", recvs, dist.irecv)):
        for t, peer in items:
            if not t.is_contiguous():
                raise ValueError(f"exchange: {kind} buffers must be contiguous, got strides {t.stride()} for shape "
                                 f"{tuple(t.shape)}")
            tag = tags.get((kind, peer), 0)
            tags[(kind, peer)] = tag + 1
            ops.append(dist.P2POp(fn, t, global_rank(group, peer), group=process_group(group), tag=tag))
    _record(
        "p2p",
        payload=sum(nbytes(t) for t, _ in sends),
        sent=sum(nbytes(t) for t, _ in sends),
        received=sum(nbytes(t) for t, _ in recvs),
        messages=len(sends),
    )
    return Step(dist.batch_isend_irecv(ops))
