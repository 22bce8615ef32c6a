"""The state each rank needs from the others: the sequence-parallel part of linear attention.

Rank r of a group holds the r-th contiguous chunk of the sequence. A causal prefill needs, on rank
r, the *incoming* state: initial + the states of ranks 0 .. r-1 (an exclusive prefix sum). The
sum over every rank, the *total*, is what decoding continues from (and what a non-causal call
attends to). Two ways to get them:

    "allgather"  one all-gather of every rank's state; each rank folds the p states in rank order
                 (the same additions on every rank, so the total is bit-identical everywhere).
                 1 round, (p - 1) * state bytes received per rank.
    "scan"       a Hillis-Steele scan over p2p messages: in round i (d = 2^i) rank r sends its
                 running sum to r + d and adds the one from r - d. ceil(log2 p) rounds, at most one
                 state sent and one received per round. The total then comes from the last rank
                 by one broadcast (only when asked for).

A state is packed into one flat buffer [kv, k_sum], so each message or collective is one tensor.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from treeattn.linear.kernel import LinearAttentionState
from treeattn.parallel import comm

EXCHANGE_METHODS = ("allgather", "scan")


def pack(state: LinearAttentionState) -> torch.Tensor:
    return torch.cat((state.kv.reshape(-1), state.k_sum.reshape(-1)))


def unpack(buffer: torch.Tensor, like: LinearAttentionState) -> LinearAttentionState:
    n = like.kv.numel()
    return LinearAttentionState(buffer[:n].view(like.kv.shape), buffer[n:].view(like.k_sum.shape))


def exchange_states(
    local: LinearAttentionState,
    initial: LinearAttentionState,
    group: dist.ProcessGroup | None,
    *,
    method: str,
    need_incoming: bool,
    need_total: bool,
) -> tuple[LinearAttentionState | None, LinearAttentionState | None]:
    """(incoming, total) for this rank: initial + the states of the ranks before it, and initial + all.

    local: this rank's chunk's state (its own keys only); initial: the state before the whole
    sequence, the same on every rank. Either result is None when not asked for.
    """
    p, rank = comm.group_size(group), comm.group_rank(group)
    if p == 1 or local.kv.numel() == 0:  # one rank, or B == 0 (nothing to send on any rank)
        total = initial + local if need_total else None
        return (initial if need_incoming else None), total
    if method == "allgather":
        pieces = comm.all_gather(pack(local), group)
        running, incoming = pack(initial), None
        for j, piece in enumerate(pieces):
            if j == rank:
                incoming = running
            running = running + piece
        return (unpack(incoming, local) if need_incoming else None), (unpack(running, local) if need_total else None)
    if method == "scan":
        incoming = None
        if need_incoming or need_total:
            partial, received = pack(local), None
            d = 1
            while d < p:
                buffer = torch.empty_like(partial)
                sends = [(partial, rank + d)] if rank + d < p else []
                recvs = [(buffer, rank - d)] if rank - d >= 0 else []
                comm.exchange(sends, recvs, group).wait()
                if recvs:
                    received = buffer if received is None else buffer + received
                    partial = buffer + partial
                d *= 2
            base = pack(initial)
            incoming = base if received is None else base + received
            inclusive = base + partial
        total = None
        if need_total:
            total = comm.broadcast(inclusive.contiguous(), p - 1, group)
        return (unpack(incoming, local) if need_incoming else None), (unpack(total, local) if need_total else None)
    raise ValueError(f"method must be one of {EXCHANGE_METHODS}, got {method!r}")
