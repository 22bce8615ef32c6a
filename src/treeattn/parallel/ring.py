"""Ring attention: the baselines for decoding (ring_decode) and causal prefill (ring_attention).

The ranks of a group form a ring (rank r sends to r + 1 and receives from r - 1, modulo p).

- ring_decode, pass_kv=True (the paper's baseline): every K/V shard travels the whole ring, p - 1
  steps. Step s posts the send of the block in hand and the receive of the next one (non-blocking,
  double-buffered), computes attention on the block in hand while the transfer runs, then waits.
  Per step the ring moves 2*b*t*d elements per rank, 2*b*t*d*p in all (paper eq. 10).
- ring_decode, pass_kv=False ("pass-Q", the fair ring): K/V stay put; each rank's partial state
  (out, lse) travels the ring instead, p - 1 steps of tiny messages. It has the ring's p - 1
  sequential rounds but the tree's small volume, which separates "log p vs p rounds" from "bytes
  moved".
- ring_attention: prefill. Every rank holds its own query chunk and K/V chunk; K/V rotate as in
  pass-KV and each block is merged into the running state. Causality is decided by absolute
  positions, so contiguous and striped (round-robin) token layouts both work; blocks that no
  query of this rank can see are skipped (not computed; they still travel on).

In ring_decode every rank keeps the p partial states and merges them with merge_states_list in
source-rank order at the end, so the result is bit-identical on every rank.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from treeattn.ops import attention, merge_states, merge_states_list
from treeattn.ops.graph_safe import graph_safe_attention
from treeattn.ops.validation import check_qkv, check_scale, check_softcap, check_window
from treeattn.parallel import comm
from treeattn.parallel.inputs import MATCHED_FIELDS, DecodeInputs, decode_inputs, input_fields, per_batch, positions
from treeattn.parallel.metadata import UNKNOWN, device_code, dtype_code, float_code, validate_and_agree
from treeattn.parallel.packing import accumulation_dtype, pack_state, unpack_state

logger = logging.getLogger(__name__)

NO_POSITION = torch.iinfo(torch.int64).max  # kv_pos minimum of an empty block: never visible


def ring_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    scale: float | None = None,
    q_pos: torch.Tensor | None = None,
    kv_pos: torch.Tensor | None = None,
    pass_kv: bool = True,
    check_inputs: bool = True,
    shard_lengths: Sequence[int] | None = None,
    graph_safe: bool = False,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact attention of q over the KV cache sharded across `group`, by a ring.

    Same contract as tree_decode (same arguments, same result up to rounding); only the
    communication differs.

    Args:
        q: (B, Sq, Hq, D), the same on every rank.
        k: (B, Sk, Hkv, D), this rank's keys; Sk may differ between ranks and may be 0.
        v: (B, Sk, Hkv, Dv), this rank's values.
        group: process group; None is the default world group.
        scale: softmax scale, default D ** -0.5.
        q_pos: int64 (Sq,) or (B, Sq); kv_pos: int64 (Sk,) or (B, Sk). Both or neither; with them a
            key is visible iff kv_pos <= q_pos. With pass_kv the positions travel with the keys.
        pass_kv: True: K/V shards travel (p - 1 steps, compute overlapped with the next transfer).
            False: partial states travel (p - 1 steps of small messages).
        check_inputs: validate this rank's inputs and all-gather a few integers first (with
            checksums of q and q_pos, which must be the same on every rank) so that disagreeing
            ranks raise the same ValueError. pass_kv=True without shard_lengths always gathers the
            shard lengths (the receivers must size their buffers); the flag then only decides
            whether the rest is validated and compared.
        shard_lengths: Sk of every rank of the group in group-rank order (host ints the caller
            already knows, e.g. from the cache placement), or None. With pass_kv=True and
            check_inputs=False they replace the gather of the lengths, so the ring is the only
            communication. With check_inputs=True they are compared with the gathered lengths.
            Entry [this rank] must equal k.shape[1].
        graph_safe: no host synchronization anywhere in the call, as in tree_decode: every block's
            attention is treeattn.ops.graph_safe.graph_safe_attention. Needs check_inputs=False
            when p > 1, and shard_lengths with pass_kv=True.
        softcap: logit soft-capping c: scores s become c * tanh(s / c); None: none.

    Returns:
        out: (B, Sq, Hq, Dv) in q.dtype; lse: (B, Hq, Sq) float32 (float64 for float64 inputs);
        identical on every rank.

    Example (on every rank of a group, as for tree_decode)::

        >>> import torch, torch.distributed as dist, treeattn as ta
        >>> rank, p = dist.get_rank(), dist.get_world_size()
        >>> g = torch.Generator().manual_seed(0)                       # the same tensors on every rank
        >>> q = torch.randn(1, 1, 8, 64, generator=g)
        >>> k, v = torch.randn(2, 1, 1000, 2, 64, generator=g)
        >>> mine = slice(rank * 1000 // p, (rank + 1) * 1000 // p)
        >>> out, lse = ta.ring_decode(q, k[:, mine], v[:, mine])                      # pass-KV: the shards travel
        >>> out_q, lse_q = ta.ring_decode(q, k[:, mine], v[:, mine], pass_kv=False)   # pass-Q: the (out, lse) state travels
        >>> full = ta.attention(q, k, v)[0]
        >>> torch.allclose(out, full, atol=1e-5) and torch.allclose(out_q, full, atol=1e-5)
        True
    """
    p = comm.group_size(group)

    def validate() -> tuple[DecodeInputs, list[int] | None]:
        inputs = decode_inputs(q, k, v, scale, q_pos, kv_pos, softcap, check=check_inputs)
        if not isinstance(pass_kv, bool):
            raise TypeError(f"pass_kv must be a bool, got {type(pass_kv).__name__}")
        lengths = _check_shard_lengths(shard_lengths, p, comm.group_rank(group), inputs.Sk)
        if not isinstance(graph_safe, bool):
            raise TypeError(f"graph_safe must be a bool, got {type(graph_safe).__name__}")
        if graph_safe and p > 1 and check_inputs:
            raise ValueError("graph_safe=True needs check_inputs=False: the input check reads gathered metadata on the host")
        if graph_safe and p > 1 and pass_kv and lengths is None:
            raise ValueError("graph_safe=True with pass_kv=True needs shard_lengths (else they are gathered to the host)")
        return inputs, lengths

    def fields(validated) -> dict:
        return {
            **input_fields(q, None if validated is None else validated[0], digests=check_inputs),
            "pass_kv": int(pass_kv) if isinstance(pass_kv, bool) else UNKNOWN,
            "shard_lengths": UNKNOWN if validated is None else _lengths_code(validated[1]),
        }

    # pass-KV receivers size their buffers by every rank's Sk: gathered unless shard_lengths are given.
    (inputs, shard_lengths), table = validate_and_agree(
        "ring_decode", group, validate, fields,
        gather=p > 1 and (check_inputs or (pass_kv is True and shard_lengths is None)),
        must_match=(*MATCHED_FIELDS, "pass_kv", "shard_lengths") if check_inputs else ("pass_kv",),
        formatters={"shard_lengths": lambda c: "None" if c == 0 else f"a list with digest {c}"},
    )
    if table is not None:
        gathered = [row["Sk"] for row in table]
        if shard_lengths is not None and gathered != shard_lengths:
            raise ValueError(f"ring_decode: shard_lengths {shard_lengths} differ from the ranks' k.shape[1] {gathered}")

    acc = accumulation_dtype(q.dtype)

    def block_state(k_block, v_block, kv_pos_block):
        if graph_safe:
            out, lse = graph_safe_attention(q, k_block, v_block, scale=inputs.scale, q_pos=inputs.q_pos, kv_pos=kv_pos_block,
                                            softcap=inputs.softcap)
        else:
            out, lse = attention(q, k_block, v_block, scale=inputs.scale, causal=inputs.masked, q_pos=inputs.q_pos,
                                 kv_pos=kv_pos_block, softcap=inputs.softcap)
        return out.to(acc), lse.to(acc)

    if p == 1:
        out, lse = block_state(k, v, inputs.kv_pos)
    elif pass_kv:
        lengths = shard_lengths if shard_lengths is not None else [row["Sk"] for row in table]
        kv_pos_full = per_batch(inputs.kv_pos, inputs.B)
        states = [None] * p

        def visit(src, k_block, v_block, kv_pos_block):
            states[src] = block_state(k_block, v_block, kv_pos_block)

        _rotate_kv(k, v, kv_pos_full, lengths, group, visit)
        states = [state for state in states if state is not None]
        if not states:  # every shard is empty
            states = [block_state(k, v, inputs.kv_pos)]
        out, lse = merge_states_list([s[0] for s in states], [s[1] for s in states])
    else:
        out, lse = _ring_gather_states(*block_state(k, v, inputs.kv_pos), group)
    return out.to(q.dtype), lse


def _check_shard_lengths(shard_lengths, p: int, rank: int, Sk: int) -> list[int] | None:
    """shard_lengths as a list of p ints >= 0 whose entry [rank] is this rank's Sk, or None."""
    if shard_lengths is None:
        return None
    if isinstance(shard_lengths, torch.Tensor) or not isinstance(shard_lengths, Sequence):
        raise TypeError(f"shard_lengths must be a sequence of {p} ints (host values), got {type(shard_lengths).__name__}")
    lengths = list(shard_lengths)
    if len(lengths) != p or any(isinstance(n, bool) or not isinstance(n, int) or n < 0 for n in lengths):
        raise ValueError(f"shard_lengths must hold one int >= 0 per rank of the group ({p}), got {lengths!r:.200}")
    if lengths[rank] != Sk:
        raise ValueError(f"shard_lengths[{rank}] = {lengths[rank]} must equal this rank's k.shape[1] = {Sk}")
    return lengths


def _lengths_code(lengths: list[int] | None) -> int:
    """An int64 digest of shard_lengths for the agreement check (0 for None)."""
    if lengths is None:
        return 0
    digest = hashlib.blake2b(repr(lengths).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True) or 1


def _rotate_kv(k, v, kv_pos, lengths, group, visit) -> None:
    """Send every K/V shard (with its positions) around the ring, calling
    ``visit(src, k_block, v_block, kv_pos_block)`` on each non-empty block while it is in hand.

    Step s (0 <= s < p) holds the block of source rank (r - s) mod p. Before computing on it, the
    step posts its send to r + 1 and the receive of the next block from r - 1; after computing it
    waits for both. Blocks are received into two buffers used in turn (double buffering): the
    block in hand is in one, the next arrives in the other. So besides its own shard a rank holds
    at most two blocks, allocated once per call (first-touching fresh pages on every step would
    cost as much as the copy on a CPU). Empty blocks are neither sent nor visited.

    Args:
        k: (B, Sk, Hkv, D), v: (B, Sk, Hkv, Dv): this rank's shard.
        kv_pos: int64 (B, Sk) or None.
        lengths: Sk of every rank of the group (so every rank knows every block's size).
    """
    p, r = comm.group_size(group), comm.group_rank(group)
    nxt, prv = (r + 1) % p, (r - 1) % p
    B, _, Hkv, D = k.shape
    Dv = v.shape[-1]
    incoming = [(r - s - 1) % p for s in range(p - 1)]  # source of the block received in step s
    longest = max((lengths[src] for src in incoming), default=0)
    n_buffers = min(2, p - 1)
    flat = [
        (
            torch.empty(B * longest * Hkv * D, dtype=k.dtype, device=k.device),
            torch.empty(B * longest * Hkv * Dv, dtype=v.dtype, device=v.device),
            None if kv_pos is None else torch.empty(B * longest, dtype=torch.int64, device=kv_pos.device),
        )
        for _ in range(n_buffers)
    ]

    def receive_buffers(step: int, n: int):
        k_flat, v_flat, pos_flat = flat[step % n_buffers]
        return (
            k_flat[: B * n * Hkv * D].view(B, n, Hkv, D),
            v_flat[: B * n * Hkv * Dv].view(B, n, Hkv, Dv),
            None if pos_flat is None else pos_flat[: B * n].view(B, n),
        )

    block = (k.contiguous(), v.contiguous(), None if kv_pos is None else kv_pos.contiguous())
    src = r
    for s in range(p):
        step = None
        if s < p - 1:
            next_block = receive_buffers(s, lengths[incoming[s]])
            sends = [(t, nxt) for t in block if t is not None]
            recvs = [(t, prv) for t in next_block if t is not None]
            step = comm.exchange(sends, recvs, group)
        if lengths[src] > 0:
            visit(src, *block)
        if step is not None:
            step.wait()
            block, src = next_block, incoming[s]


def _ring_gather_states(out: torch.Tensor, lse: torch.Tensor, group) -> tuple[torch.Tensor, torch.Tensor]:
    """Pass-Q ring: each rank's state travels p - 1 steps (step s forwards the state received in
    step s - 1); at the end every rank holds all p states and merges them in rank order."""
    p, r = comm.group_size(group), comm.group_rank(group)
    nxt, prv = (r + 1) % p, (r - 1) % p
    packed = [None] * p
    packed[r] = pack_state(out, lse)
    for s in range(p - 1):
        incoming = (r - s - 1) % p
        packed[incoming] = torch.empty_like(packed[r])
        comm.exchange([(packed[(r - s) % p], nxt)], [(packed[incoming], prv)], group).wait()
    states = [unpack_state(buffer, out.shape) for buffer in packed]
    return merge_states_list([s[0] for s in states], [s[1] for s in states])


@dataclass(frozen=True)
class _PrefillInputs:
    """ring_attention's validated inputs on this rank."""

    dims: tuple[int, ...]  # (B, Sq, Sk, Hq, Hkv, D, Dv)
    scale: float
    window: int | None
    softcap: float | None
    q_pos: torch.Tensor | None  # int64 (Sq,) or (B, Sq)
    kv_pos: torch.Tensor | None
    q_max: int  # the largest query position (UNKNOWN without positions)
    kv_min: int  # the smallest key position (NO_POSITION for no key; UNKNOWN without positions)


# The metadata ring_attention's ranks exchange; the first 12 must match on every rank.
_PREFILL_FIELDS = ("B (q.shape[0])", "Hq (q.shape[2])", "Hkv (k.shape[2])", "D (q.shape[3])", "Dv (v.shape[3])",
                   "dtype", "device", "scale", "window", "softcap", "causal", "positions given",
                   "Sq", "Sk", "max q_pos", "min kv_pos")


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    scale: float | None = None,
    causal: bool = True,
    q_pos: torch.Tensor | None = None,
    kv_pos: torch.Tensor | None = None,
    check_inputs: bool = True,
    window: int | None = None,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Prefill attention with the sequence sharded across `group`: each rank's queries attend to
    the keys of every rank, K/V rotating around the ring.

    Args:
        q: (B, Sq, Hq, D), this rank's query chunk (Sq may differ between ranks, may be 0).
        k: (B, Sk, Hkv, D), v: (B, Sk, Hkv, Dv): this rank's K/V chunk (Sk may differ, may be 0).
        group: process group; None is the default world group.
        scale: softmax scale, default D ** -0.5.
        causal: mask keys after the query. Positions decide; without q_pos/kv_pos the layout is
            contiguous in rank order: rank r's keys are tokens off_r .. off_r + Sk_r - 1 (off_r
            the total Sk of ranks before r) and its queries are its last Sq tokens.
        q_pos: int64 (Sq,) or (B, Sq); kv_pos: int64 (Sk,) or (B, Sk): absolute token positions,
            both or neither, only with causal=True. Any layout, e.g. striped (token i on rank i % p).
        check_inputs: compare the metadata of all ranks first (the shard lengths and position
            ranges are gathered in any case, to size buffers and to skip masked blocks).
        window: sliding window W (only with causal=True): a key is also hidden when
            q_pos - kv_pos >= W. None: no window.
        softcap: logit soft-capping c: scores s become c * tanh(s / c); None: none.

    Returns:
        out: (B, Sq, Hq, Dv) in q.dtype; lse: (B, Hq, Sq) float32 (float64 for float64 inputs):
        this rank's queries over all keys they may see. A query that sees none: out 0, lse -inf.

    Example (causal prefill: each rank holds a chunk of the prompt's queries, keys and values)::

        >>> import torch, torch.distributed as dist, treeattn as ta
        >>> rank, p = dist.get_rank(), dist.get_world_size()
        >>> g = torch.Generator().manual_seed(0)                       # the same tensors on every rank
        >>> q, k, v = torch.randn(3, 1, 64, 4, 32, generator=g)          # the whole prompt, (B, S, H, D) each
        >>> mine = slice(rank * 64 // p, (rank + 1) * 64 // p)
        >>> out, lse = ta.ring_attention(q[:, mine], k[:, mine], v[:, mine])   # positions: the chunks in rank order
        >>> torch.allclose(out, ta.attention(q, k, v, causal=True)[0][:, mine], atol=1e-5)
        True
    """
    p, r = comm.group_size(group), comm.group_rank(group)

    def validate() -> _PrefillInputs:
        B, Sq, Sk, Hq, Hkv, D, Dv = check_qkv(q, k, v)
        checked_scale = check_scale(scale, D)
        checked_window, checked_softcap = check_window(window), check_softcap(softcap)
        if not isinstance(causal, bool):
            raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
        if checked_window is not None and not causal:
            raise ValueError(f"window={window} needs causal=True (ring_attention windows are causal sliding windows)")
        if (q_pos is None) != (kv_pos is None):
            raise ValueError("q_pos and kv_pos must be given together, got only one of them")
        if q_pos is not None and not causal:
            raise ValueError("q_pos/kv_pos only take effect with causal=True; pass causal=True or drop them")
        checked_q_pos = positions(q_pos, "q_pos", B, Sq, q.device)
        checked_kv_pos = positions(kv_pos, "kv_pos", B, Sk, q.device)
        q_max = kv_min = UNKNOWN
        if checked_q_pos is not None:
            q_max = int(checked_q_pos.max()) if Sq > 0 else -1
            kv_min = int(checked_kv_pos.min()) if Sk > 0 else NO_POSITION
        return _PrefillInputs((B, Sq, Sk, Hq, Hkv, D, Dv), checked_scale, checked_window, checked_softcap,
                              checked_q_pos, checked_kv_pos, q_max, kv_min)

    def fields(inputs: _PrefillInputs | None) -> dict:
        if inputs is None:
            return dict.fromkeys(_PREFILL_FIELDS, UNKNOWN)
        B, Sq, Sk, Hq, Hkv, D, Dv = inputs.dims
        return dict(zip(_PREFILL_FIELDS, (
            B, Hq, Hkv, D, Dv, dtype_code(q.dtype), device_code(q.device), float_code(inputs.scale),
            0 if inputs.window is None else inputs.window,
            0 if inputs.softcap is None else float_code(inputs.softcap),
            int(causal), int(inputs.q_pos is not None), Sq, Sk, inputs.q_max, inputs.kv_min,
        )))

    inputs, table = validate_and_agree(
        "ring_attention", group, validate, fields,
        gather=p > 1,  # always: the shard lengths and position ranges size buffers and skip blocks
        must_match=_PREFILL_FIELDS[:12] if check_inputs else ("positions given",),
    )
    table = table or [fields(inputs)]
    B, Sq, Sk, Hq, Hkv, D, Dv = inputs.dims
    scale, window, softcap = inputs.scale, inputs.window, inputs.softcap
    q_pos, kv_pos, q_max = inputs.q_pos, inputs.kv_pos, inputs.q_max
    lengths = [row["Sk"] for row in table]

    if causal and q_pos is None:  # contiguous layout in rank order
        offset = sum(lengths[:r])
        kv_pos = torch.arange(offset, offset + Sk, device=q.device)
        q_pos = torch.arange(offset + Sk - Sq, offset + Sk, device=q.device)
        offsets = [sum(lengths[:j]) for j in range(p)]
        q_max = offset + Sk - 1
        mins = [offsets[j] if lengths[j] > 0 else NO_POSITION for j in range(p)]
    else:
        mins = [row["min kv_pos"] for row in table]

    acc = accumulation_dtype(q.dtype)
    state = None

    def visit(src, k_block, v_block, kv_pos_block):
        nonlocal state
        if causal and mins[src] > q_max:
            return  # no query of this rank sees any key of the block
        out, lse = attention(q, k_block, v_block, scale=scale, causal=causal, q_pos=q_pos, kv_pos=kv_pos_block,
                             window=window, softcap=softcap)
        out, lse = out.to(acc), lse.to(acc)
        state = (out, lse) if state is None else merge_states(*state, out, lse)

    kv_pos_full = per_batch(kv_pos, B)
    if p == 1:
        if Sk > 0:
            visit(0, k, v, kv_pos_full)
    else:
        _rotate_kv(k, v, kv_pos_full, lengths, group, visit)
    if state is None:
        out = torch.zeros(B, Sq, Hq, Dv, dtype=q.dtype, device=q.device)
        return out, torch.full((B, Hq, Sq), float("-inf"), dtype=acc, device=q.device)
    return state[0].to(q.dtype), state[1]
