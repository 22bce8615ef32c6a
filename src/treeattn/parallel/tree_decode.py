"""Tree decoding (papers/tree-attention.txt, Algorithm 3 and section 5.3).

The KV cache is sharded along the sequence across the ranks of a group; the query is the same on
every rank. Each rank computes the attention state (out, lse) of its own shard with
treeattn.ops.attention, and the p states are combined exactly. Because the combine is associative,
it takes O(log p) communication rounds and moves only O(b * d) numbers, never K or V.

Three ways to combine:

- "allreduce": Algorithm 3. m = Allreduce(max, lse); then ONE Allreduce(sum) of the packed buffer
  [out * exp(lse - m), exp(lse - m)] (the paper's two sums share one collective: two collectives
  per step, not three); out = numerator / denominator, lse = m + log(denominator). The backend
  (gloo, NCCL) chooses the reduction pattern. This is the only combine in treeattn that does not
  call merge_states: the sum inside the collective is the merge, written as Algorithm 3 writes it.
- "tree": merge_states itself as the reduction operator over an explicit binomial tree of
  send/recv, rooted at group rank 0: ceil(log2 p) rounds up, the same down (the root sends the
  result back). One message per tree edge: out and lse packed in one buffer. Any p.
- "twolevel": topology-aware. A binomial merge tree inside each node to its leader, the
  "allreduce" combine among the leaders, a broadcast inside each node. Only leaders use the slow
  links between nodes.
- "onepass": ONE collective in the common case. Algorithm 3 needs its max pass only to keep
  exp() in range; here every rank scales against a reference it knows without communicating, 0,
  and the packed [out * exp(lse), exp(lse)] travels in float64, whose exponent covers |lse| up
  to ~700. One Allreduce(sum) of that buffer plus one more element, the number of rows on each
  rank whose lse lies outside +-ONEPASS_WINDOW; then out = numerator / denominator,
  lse = log(denominator). Whether that was exact is decided from the reduced buffer alone (no row
  outside the window on any rank, every numerator finite): every rank holds the same reduced
  buffer, so every rank takes the same branch, and when the check fails all of them fall back
  together to "allreduce" (two more collectives) on their own states. Rounds: 1, or 3 on the
  fallback. Rounds stay O(log p) on a tree-capable allreduce (NCCL's tree, gloo's), unlike an
  all-gather of the states (p - 1 steps on a ring). The check reads one number on the host, so
  onepass does not run with graph_safe=True.

Every method returns bit-identical results on every rank. Partial states are combined in float32
(float64 for float64 inputs) and the result is cast to q.dtype once at the end.
"""

from __future__ import annotations

import logging
import math

import torch
import torch.distributed as dist

from treeattn.ops import attention, merge_states
from treeattn.ops.graph_safe import graph_safe_attention
from treeattn.ops.kernels import optional_kernel
from treeattn.parallel import comm
from treeattn.parallel.inputs import MATCHED_FIELDS, DecodeInputs, decode_inputs, input_fields
from treeattn.parallel.metadata import UNKNOWN, validate_and_agree
from treeattn.parallel.packing import accumulation_dtype, pack_state, unpack_state
from treeattn.parallel.topology import Topology, node_groups

logger = logging.getLogger(__name__)

METHODS = ("allreduce", "tree", "twolevel", "onepass")

ONEPASS_WINDOW = 550.0
"""onepass stays on its one collective while every finite local lse lies in [-550, 550]: then
exp(lse) and out * exp(lse) (|out| < 3.4e38, the float32 range) are normal float64 numbers with
their 53 bits, sums of them over any p < 2^20 ranks stay finite, and the combine is as exact as
Algorithm 3's (float64 weights instead of float32). Outside, the reduced flag sends every rank
to the fallback."""


def tree_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    scale: float | None = None,
    q_pos: torch.Tensor | None = None,
    kv_pos: torch.Tensor | None = None,
    method: str = "onepass",
    topology: Topology | None = None,
    check_inputs: bool = True,
    graph_safe: bool = False,
    kv_len: torch.Tensor | None = None,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact attention of q over the KV cache sharded across the ranks of `group`.

    Call on every rank of the group with the same q and that rank's shard of the keys and values
    (shards are disjoint; their union is the whole cache, in any order).

    Args:
        q: (B, Sq, Hq, D) float32, float16, bfloat16 or float64; the same on every rank.
        k: (B, Sk, Hkv, D), this rank's keys; Sk may differ between ranks and may be 0.
            Hq % Hkv == 0 (GQA; Hkv == 1 is MQA).
        v: (B, Sk, Hkv, Dv), this rank's values.
        group: process group; None is the default world group.
        scale: softmax scale, default D ** -0.5.
        q_pos: int64 (Sq,) or (B, Sq), absolute positions of the queries (same on every rank).
        kv_pos: int64 (Sk,) or (B, Sk), absolute positions of this rank's keys. Give both or
            neither: with positions a key is visible to a query iff kv_pos <= q_pos (speculative
            decoding with Sq > 1); without, every query sees every key.
        method: "onepass" (the default, as everywhere in treeattn: one float64 Allreduce(sum)
            against the reference 0, "allreduce" as the fallback all ranks take together when it
            would not be exact), "allreduce" (Algorithm 3), "tree" (binomial merge tree) or
            "twolevel" (per node, then across node leaders). With graph_safe=True on p > 1 ranks
            give "allreduce" or "tree" (onepass decides on its fallback on the host).
        topology: for "twolevel": Topology(ranks_per_node=k); default Topology(), which reads
            LOCAL_WORLD_SIZE or puts all ranks on one node. Ignored by the other methods.
        check_inputs: validate this rank's inputs, then all-gather a few integers (shapes, dtype,
            scale, method, topology, and checksums of q and q_pos, which must be the same on every
            rank) so that ranks that disagree all raise the same ValueError instead of hanging or
            silently mixing. One small collective; turn it off only when the inputs are known to be
            valid and to agree (the engine does): then only the local attention validates them.
        graph_safe: no host synchronization anywhere in the call, so that it can run inside a
            CUDA graph (treeattn.engine.worker.static_step): this rank's attention is
            treeattn.ops.graph_safe.graph_safe_attention (on CUDA the Triton kernel, which must
            take the inputs: ValueError otherwise), never the generic path. Needs
            check_inputs=False when p > 1 (the check reads the gathered metadata on the host).
        kv_len: with graph_safe only: int32/int64 (B,) on q's device, the number of leading slots
            of k/v in use on this rank (k/v are a preallocated buffer); the rest is never
            attended, and on CUDA never read.
        softcap: logit soft-capping c (Gemma 2): every score s = scale * q.k becomes
            c * tanh(s / c) before the softmax; None: none. The same on every rank.

    Returns:
        out: (B, Sq, Hq, Dv) in q.dtype, the attention over the union of all shards.
        lse: (B, Hq, Sq) float32 (float64 for float64 inputs). A row that sees no key on any rank
            has out = 0 and lse = -inf. Both are identical on every rank.

    Raises:
        ValueError / TypeError: bad local input (on that rank; with check_inputs the other ranks
            raise a ValueError naming it), or ranks that disagree (the same error on every rank).

    Example (on every rank of a group: in ta.spawn's fn or under torchrun; group=None is the world)::

        >>> import torch, torch.distributed as dist, treeattn as ta
        >>> rank, p = dist.get_rank(), dist.get_world_size()
        >>> g = torch.Generator().manual_seed(0)                       # the same tensors on every rank
        >>> q = torch.randn(1, 1, 8, 64, generator=g)                  # one decode query, the same on every rank
        >>> k, v = torch.randn(2, 1, 1000, 2, 64, generator=g)         # the whole cache, (B, N, Hkv, D) each
        >>> mine = slice(rank * 1000 // p, (rank + 1) * 1000 // p)     # this rank's shard of the sequence
        >>> out, lse = ta.tree_decode(q, k[:, mine], v[:, mine])       # method="onepass": one collective
        >>> torch.allclose(out, ta.attention(q, k, v)[0], atol=1e-5)   # every rank gets the whole answer
        True
    """
    p = comm.group_size(group)

    def validate() -> tuple[DecodeInputs, int]:
        inputs = decode_inputs(q, k, v, scale, q_pos, kv_pos, softcap, check=check_inputs)
        if method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {method!r}")
        if topology is not None and not isinstance(topology, Topology):
            raise TypeError(f"topology must be a treeattn Topology or None, got {type(topology).__name__}")
        ranks_per_node = (topology or Topology()).resolve(p) if method == "twolevel" else 0
        _check_graph_safe(graph_safe, kv_len, check_inputs, p)
        if graph_safe and method == "onepass" and p > 1:
            raise ValueError("method='onepass' decides on its fallback on the host: with graph_safe=True use 'allreduce' or "
                             "'tree'")
        return inputs, ranks_per_node

    def fields(validated) -> dict:
        return {
            **input_fields(q, None if validated is None else validated[0]),
            "method": METHODS.index(method) if method in METHODS else UNKNOWN,
            "ranks_per_node": UNKNOWN if validated is None else validated[1],
        }

    (inputs, ranks_per_node), _ = validate_and_agree(
        "tree_decode", group, validate, fields,
        gather=check_inputs and p > 1,
        must_match=(*MATCHED_FIELDS, "method", "ranks_per_node"),
        formatters={"method": lambda c: repr(METHODS[c]) if 0 <= c < len(METHODS) else "invalid"},
    )
    out, lse = _local_state(q, k, v, inputs, graph_safe, kv_len)
    out, lse = combine_states(out, lse, group=group, method=method, ranks_per_node=ranks_per_node)
    return out.to(q.dtype), lse


def combine_states(
    out: torch.Tensor, lse: torch.Tensor, *, group: dist.ProcessGroup | None, method: str, ranks_per_node: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge every rank's attention state across `group` with `method` (tree_decode's combine step,
    without its input checks: call it on every rank with the same method, shapes and dtype).

    Args:
        out: (B, Sq, Hq, Dv) float32/float64, this rank's state; lse: (B, Hq, Sq), same dtype.
        method: one of METHODS.
        ranks_per_node: for "twolevel", the resolved Topology(...).resolve(p).

    Returns:
        The merged state, same shapes and dtypes, identical on every rank.
    """
    if comm.group_size(group) == 1:
        return out, lse
    if method == "allreduce":
        return allreduce_combine(out, lse, group)
    if method == "onepass":
        return onepass_combine(out, lse, group)
    if method == "tree":
        members = list(range(comm.group_size(group)))
        return tree_broadcast(tree_reduce(out, lse, members, group), (out, lse), members, group)
    return _twolevel_combine(out, lse, group, ranks_per_node)


def _check_graph_safe(graph_safe, kv_len, check_inputs: bool, p: int) -> None:
    """The graph_safe / kv_len arguments of tree_decode."""
    if not isinstance(graph_safe, bool):
        raise TypeError(f"graph_safe must be a bool, got {type(graph_safe).__name__}")
    if kv_len is not None and not graph_safe:
        raise ValueError("kv_len is only taken with graph_safe=True (static-shape decoding over a preallocated buffer)")
    if graph_safe and check_inputs and p > 1:
        raise ValueError("graph_safe=True needs check_inputs=False: the input check reads gathered metadata on the host")


def _local_state(q, k, v, inputs: DecodeInputs, graph_safe: bool = False, kv_len=None) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's state in the accumulation dtype: out (B, Sq, Hq, Dv), lse (B, Hq, Sq)."""
    if graph_safe:
        out, lse = graph_safe_attention(q, k, v, scale=inputs.scale, q_pos=inputs.q_pos, kv_pos=inputs.kv_pos, kv_len=kv_len,
                                        softcap=inputs.softcap)
    else:
        out, lse = attention(q, k, v, scale=inputs.scale, causal=inputs.masked, q_pos=inputs.q_pos, kv_pos=inputs.kv_pos,
                             softcap=inputs.softcap)
    acc = accumulation_dtype(q.dtype)
    return out.to(acc), lse.to(acc)


def allreduce_combine(
    out: torch.Tensor, lse: torch.Tensor, group: dist.ProcessGroup | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Algorithm 3 on one group: Allreduce(max) of lse, then one Allreduce(sum) of the packed
    [out * exp(lse - m), exp(lse - m)].

    Args:
        out: (B, Sq, Hq, Dv) float32/float64, this rank's state; lse: (B, Hq, Sq), same dtype.

    Returns:
        The merged state over all ranks of `group`, same shapes and dtypes, identical on every rank.
    """
    top = comm.all_reduce(lse.clone(memory_format=torch.contiguous_format), dist.ReduceOp.MAX, group)
    top = torch.where(torch.isneginf(top), torch.zeros_like(top), top)  # rows no rank sees: any finite m
    weight = torch.exp(lse - top)  # (B, Hq, Sq); 0 where this rank sees no key
    buffer = torch.empty(out.numel() + lse.numel(), dtype=out.dtype, device=out.device)
    numerator, denominator = unpack_state(buffer, out.shape)
    torch.mul(out, weight.transpose(1, 2).unsqueeze(-1), out=numerator)
    denominator.copy_(weight)
    comm.all_reduce(buffer, dist.ReduceOp.SUM, group)
    safe = torch.where(denominator > 0, denominator, torch.ones_like(denominator))
    merged_out = numerator / safe.transpose(1, 2).unsqueeze(-1)
    merged_lse = top + torch.log(denominator)  # log(0) = -inf: the row saw no key anywhere
    return merged_out, merged_lse


def onepass_combine(
    out: torch.Tensor, lse: torch.Tensor, group: dist.ProcessGroup | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """One Allreduce(sum) of the float64 buffer [out * exp(lse), exp(lse), rows outside the window]
    (the reference is 0 on every rank); allreduce_combine on every rank when the reduced buffer
    says the one pass was not exact (see ONEPASS_WINDOW).

    Args:
        out: (B, Sq, Hq, Dv) float32/float64, this rank's state; lse: (B, Hq, Sq), same dtype.

    Returns:
        The merged state over all ranks of `group`, in out's dtype, identical on every rank.
    """
    kernel = _combine_kernel(out, lse)
    if kernel is not None:
        return _onepass_combine_cpu(kernel, out, lse, group)
    n_state = out.numel() + lse.numel()
    buffer = torch.empty(n_state + 1, dtype=torch.float64, device=out.device)
    numerator, denominator = unpack_state(buffer[:n_state], out.shape)
    denominator.copy_(lse).exp_()  # in float64; 0 where this rank sees no key (lse = -inf)
    torch.mul(out, denominator.transpose(1, 2).unsqueeze(-1), out=numerator)
    buffer[n_state:].copy_((torch.isfinite(lse) & (lse.abs() > ONEPASS_WINDOW)).sum())
    comm.all_reduce(buffer, dist.ReduceOp.SUM, group)
    # Every rank holds the same reduced buffer, so every rank takes the same branch here.
    exact = (buffer[n_state] == 0) & torch.isfinite(numerator).all()
    if not bool(exact):  # the one host read of the combine
        logger.debug("onepass: a state outside the float64 window; falling back to the two-collective combine")
        return allreduce_combine(out, lse, group)
    safe = torch.where(denominator > 0, denominator, torch.ones_like(denominator))
    merged_out = numerator / safe.transpose(1, 2).unsqueeze(-1)
    merged_lse = torch.log(denominator)  # log(0) = -inf: the row saw no key anywhere
    return merged_out.to(out.dtype), merged_lse.to(lse.dtype)


def _combine_kernel(out: torch.Tensor, lse: torch.Tensor):
    """treeattn.ops.combine_cpu_kernel for CPU states of float32 or float64 (both the same dtype)
    outside autograd, else None (the torch path)."""
    if (out.device.type != "cpu" or out.dtype not in (torch.float32, torch.float64) or lse.dtype != out.dtype
            or (torch.is_grad_enabled() and (out.requires_grad or lse.requires_grad))):
        return None
    return optional_kernel("combine_cpu_kernel")


def _onepass_combine_cpu(kernel, out: torch.Tensor, lse: torch.Tensor, group) -> tuple[torch.Tensor, torch.Tensor]:
    """onepass_combine's arithmetic in two compiled calls around the one all-reduce
    (treeattn.ops.combine_cpu_kernel: the same float64 buffer, the same fallback)."""
    out_c, lse_c = out.contiguous(), lse.contiguous()
    buffer = torch.empty(out.numel() + lse.numel() + 1, dtype=torch.float64)
    kernel.onepass_pack(out_c.numpy(), lse_c.numpy(), ONEPASS_WINDOW, buffer.numpy())
    comm.all_reduce(buffer, dist.ReduceOp.SUM, group)
    merged_out, merged_lse = torch.empty_like(out_c), torch.empty_like(lse_c)
    if kernel.onepass_unpack(buffer.numpy(), merged_out.numpy(), merged_lse.numpy()):
        return merged_out, merged_lse
    logger.debug("onepass: a state outside the float64 window; falling back to the two-collective combine")
    return allreduce_combine(out, lse, group)


def tree_reduce(
    out: torch.Tensor, lse: torch.Tensor, members: list[int], group: dist.ProcessGroup | None
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Merge the states of `members` (group ranks) up a binomial tree to members[0].

    In round r = 0 .. ceil(log2 n) - 1, member i with i % 2^(r+1) == 2^r sends its (partial)
    state to member i - 2^r and is done; member i with i % 2^(r+1) == 0 receives from i + 2^r
    (if it exists) and merges, its own keys first. Returns the merged state on members[0], None
    on the others.
    """
    i, n = members.index(comm.group_rank(group)), len(members)
    for r in range(math.ceil(math.log2(n)) if n > 1 else 0):
        step = 1 << r
        if i % (2 * step) == step:
            comm.exchange([(pack_state(out, lse), members[i - step])], [], group).wait()
            return None
        if i + step < n:
            buffer = torch.empty(out.numel() + lse.numel(), dtype=lse.dtype, device=lse.device)
            comm.exchange([], [(buffer, members[i + step])], group).wait()
            out, lse = merge_states(out, lse, *unpack_state(buffer, out.shape))
    return out, lse


def tree_broadcast(
    state: tuple[torch.Tensor, torch.Tensor] | None,
    like: tuple[torch.Tensor, torch.Tensor],
    members: list[int],
    group: dist.ProcessGroup | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Send members[0]'s state down the binomial tree of tree_reduce (rounds in reverse order),
    one packed message per edge.

    Args:
        state: the state to send, on members[0]; None on the others.
        like: a state (out, lse) of the same shapes, dtype and device (this rank's own), to size
            the receive buffer.

    Returns:
        members[0]'s state, on every member.
    """
    i, n = members.index(comm.group_rank(group)), len(members)
    if n == 1:
        return state
    out_shape = like[0].shape
    buffer = pack_state(*state) if i == 0 else None
    for r in reversed(range(math.ceil(math.log2(n)))):
        step = 1 << r
        if i % (2 * step) == 0 and i + step < n:
            comm.exchange([(buffer, members[i + step])], [], group).wait()
        elif i % (2 * step) == step:
            buffer = torch.empty(like[0].numel() + like[1].numel(), dtype=like[1].dtype, device=like[1].device)
            comm.exchange([], [(buffer, members[i - step])], group).wait()
    return unpack_state(buffer, out_shape)


def _twolevel_combine(
    out: torch.Tensor, lse: torch.Tensor, group: dist.ProcessGroup | None, ranks_per_node: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge tree inside each node to its leader; Algorithm 3 among the leaders; broadcast inside
    each node from its leader."""
    groups = node_groups(group, ranks_per_node)
    merged = tree_reduce(out, lse, groups.node_ranks, group)
    is_leader = merged is not None
    if is_leader and groups.leaders is not None:
        merged = allreduce_combine(*merged, groups.leaders)
    if groups.node is None:  # one rank per node: the leader holds the result
        return merged
    buffer = pack_state(*merged) if is_leader else torch.empty(out.numel() + lse.numel(), dtype=lse.dtype, device=lse.device)
    comm.broadcast(buffer, 0, groups.node)
    return unpack_state(buffer, out.shape)
