"""Cost model of one decode step (and of prefill + n decode steps) for every decoding method.

Per device, attention over t tokens is a roofline: a fixed kernel overhead plus the larger of
(bytes of K and V) / (achieved memory bandwidth) and FLOPs / (achieved peak). Communication uses
the alpha-beta models of `treeattn.sim.collectives` on the cluster's two links. The methods are
priced as treeattn.parallel runs them:

    allreduce  local attention; allreduce(max) of lse; allreduce(sum) of the packed
               [out * exp(lse - m), exp(lse - m)] (float32); divide. NCCL picks ring or tree.
    tree       local attention; binomial-tree reduce of (out, lse) with merge_states
               (ceil(log2 p) rounds); binomial broadcast of the result (ceil(log2 p) rounds).
    onepass    local attention; ONE allreduce(sum) of the packed [out * exp(lse), exp(lse), flag]
               in float64 (B x Hq x (Dv + 1) + 1 elements of 8 bytes); one host read of the
               reduced flag (Cluster.host_read_seconds); divide. Its rare fallback (states
               outside the float64 window) is not priced: it adds the allreduce method's cost.
    twolevel   binomial reduce inside each node; allreduce-method combine among node leaders over
               the inter-node link; one broadcast collective inside each node.
    ring-kv    an allgather of the shard lengths (ring_decode's metadata row, RING_METADATA_BYTES
               per rank: receivers size their buffers), then p - 1 steps; in each, the K, V block moves to the next rank while
               the block in hand is attended to (overlap: the cluster's p2p_overlap); one merge
               of the p states at the end.
    ring-q     local attention, then p - 1 steps in which the partial states travel one rank on
               (tiny messages, p - 1 latencies); one merge of the p states at the end.
    local      one device holds the whole cache.

The reported `bytes` and `rounds` follow ta.comm_stats' conventions (bytes sent by the busiest
rank; an allreduce sends 2 (p - 1) / p x payload; a collective call or a p2p step is one round),
so a benchmark's measured counters can be checked against them. `steps` counts the sequential
message latencies inside the collectives as well (what the log p vs p argument is about).

Ranks that are processes sharing one host's cores (the calibrated cpu-local preset) pay one more
term, by the rounds a decode step issues after its attention (rounds_after_attention): a round
that directly follows an attention (the first round of every method, every ring-kv step) costs
the busy-round seconds measured at that world size (Cluster.busy_round_seconds): the wake-up of a
receiving rank that slept while its peers computed, and, when ranks outnumber the cores, its wait
for a core (oversubscription); each further round issued back to back after it costs the
measured next-round seconds of its kind (Cluster.busy_next_round_seconds). The GPU presets have
no such term.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace

from treeattn.sim import volumes
from treeattn.sim.collectives import (
    NO_COMM,
    CommCost,
    binomial_broadcast,
    binomial_reduce,
    chain_broadcast,
    leaders,
    nccl_allreduce,
    node_members,
    ring_allgather,
    ring_pass,
)
from treeattn.sim.hardware import Cluster
from treeattn.sim.workload import STATE_ELEMENT_BYTES, DecodeShape

METHODS: tuple[str, ...] = ("allreduce", "onepass", "tree", "twolevel", "ring-kv", "ring-q", "local")
TREE_METHODS: tuple[str, ...] = ("allreduce", "onepass", "tree", "twolevel")
ONEPASS_ELEMENT_BYTES = 8  # onepass's packed state travels in float64
RING_METHODS: tuple[str, ...] = ("ring-kv", "ring-q")


def _ring_metadata_bytes() -> int:
    """Bytes of the int64 row each rank contributes to ring_decode(pass_kv=True)'s metadata
    allgather: the input fields, pass_kv, shard_lengths and the ok flag. Read from the code, so the
    prediction follows the implementation."""
    from treeattn.parallel.inputs import input_fields
    from treeattn.parallel.metadata import row_length

    return (row_length(input_fields(None, None)) + 2) * 8


RING_METADATA_BYTES = _ring_metadata_bytes()


def check_method(method: str) -> str:
    if method not in METHODS:
        raise ValueError(f"method must be one of {', '.join(METHODS)}, got {method!r}")
    return method


@dataclass(frozen=True)
class Prediction:
    """The model's estimate for one (method, devices, shape).

    Attributes:
        method: one of METHODS.
        gpus: devices p of the configuration.
        devices: devices the method uses (1 for local, else gpus).
        seq_len: N.
        predicted_seconds: latency of one decode step (all ranks done).
        bytes: bytes sent by the busiest rank (comm_stats convention).
        rounds: communication rounds on a rank (comm_stats convention).
        steps: sequential message latencies on the critical path, inside collectives too.
        compute_seconds: attention + merge time on the critical path.
        comm_seconds: exposed communication time on the critical path.
        paper_elements: the paper's volume (eq. 10 for ring-kv, eq. 14 for allreduce), else None.
        peak_memory_bytes: K, V and decode buffers on one device (the paper's eq. 8/9 terms).
        algorithm: the collective algorithms chosen.
        fits_memory: whether peak_memory_bytes fits in the cluster's memory_capacity (on a host
            whose ranks share the memory: devices * peak_memory_bytes); None if the capacity is
            unknown. See memory_shortfall.
    """

    method: str
    gpus: int
    devices: int
    seq_len: int
    predicted_seconds: float
    bytes: float
    rounds: int
    steps: int
    compute_seconds: float
    comm_seconds: float
    paper_elements: float | None
    peak_memory_bytes: float
    algorithm: str
    fits_memory: bool | None = None

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


def memory_shortfall(cluster: Cluster, prediction: Prediction) -> str | None:
    """None if the configuration fits in memory (or the cluster's capacity is unknown); else one
    line saying what it needs and what there is."""
    capacity = cluster.memory_capacity
    if capacity is None:
        return None
    if cluster.host_cores is not None:  # ranks on one host share its memory
        needed, where = prediction.devices * prediction.peak_memory_bytes, f"the host's {_gib(capacity)} shared by the ranks"
    else:
        needed, where = prediction.peak_memory_bytes, f"the {_gib(capacity)} of one {cluster.name} device"
    if needed <= capacity:
        return None
    per = "" if cluster.host_cores is None else f" on {prediction.devices} rank(s)"
    return (f"{prediction.method} p={prediction.gpus} N={prediction.seq_len}: the K/V cache and decode buffers need "
            f"{_gib(needed)}{per}, more than {where}")


def _gib(n: float) -> str:
    from treeattn.sim.units import format_memory

    return format_memory(n)


# ------------------------------------------------------------------------------------ compute


def _host_slowdown(cluster: Cluster, ranks: int) -> float:
    """Ranks that share `host_cores` cores time-slice: each runs ranks / cores times slower."""
    if cluster.host_cores is None:
        return 1.0
    return max(1.0, ranks / cluster.host_cores)


def attention_seconds(cluster: Cluster, shape: DecodeShape, tokens: int, ranks: int = 1) -> float:
    """Roofline time of one decode attention call over `tokens` keys on one device, while `ranks`
    devices work at once (matters only for ranks sharing a host)."""
    if tokens <= 0:
        return 0.0
    bandwidth = cluster.attention_bandwidth
    if cluster.host_cores is not None and cluster.host_memory_bandwidth is not None:
        running = min(ranks, cluster.host_cores)
        bandwidth = min(bandwidth, cluster.host_memory_bandwidth / running)
    memory_time = shape.kv_bytes(tokens) / bandwidth
    flops_time = shape.attention_flops(tokens) / (cluster.peak_flops * cluster.flops_efficiency)
    return (cluster.kernel_overhead + max(memory_time, flops_time)) * _host_slowdown(cluster, ranks)


def merge_seconds(cluster: Cluster, ranks: int = 1) -> float:
    """One merge_states of two decode states."""
    return cluster.merge_seconds * _host_slowdown(cluster, ranks)


# ----------------------------------------------------------------------------- communication


def allreduce_combine(cluster: Cluster, shape: DecodeShape, ranks: int) -> CommCost:
    """Algorithm 3's two allreduces: max of lse (B x Hq float32), then sum of the packed
    numerator and denominator (B x Hq x (Dv + 1) float32)."""
    lse_bytes = shape.batch * shape.heads * STATE_ELEMENT_BYTES
    packed_bytes = shape.batch * shape.heads * (shape.dv + 1) * STATE_ELEMENT_BYTES
    return nccl_allreduce(cluster, ranks, lse_bytes) + nccl_allreduce(cluster, ranks, packed_bytes)


def onepass_combine(cluster: Cluster, shape: DecodeShape, ranks: int) -> CommCost:
    """onepass's one allreduce: the packed numerator and denominator plus the flag, float64."""
    packed_bytes = (shape.batch * shape.heads * (shape.dv + 1) + 1) * ONEPASS_ELEMENT_BYTES
    return nccl_allreduce(cluster, ranks, packed_bytes)


def allgather_combine(cluster: Cluster, shape: DecodeShape, ranks: int) -> CommCost:
    """The alternative onepass was chosen against (not a method of tree_decode): one all-gather of
    every rank's (out, lse), then p - 1 local merges. One collective call, but a ring all-gather
    (NCCL's algorithm for it) is p - 1 latency steps, and every rank receives p states."""
    return ring_allgather(cluster, ranks, shape.state_bytes())


def _sum_costs(costs: list[CommCost]) -> CommCost:
    total = NO_COMM
    for cost in costs:
        total = total + cost
    return total


# ----------------------------------------------------------------------------------- methods


def _peak_memory_bytes(shape: DecodeShape, method: str, gpus: int) -> float:
    """K, V shard (+ the in-flight block for ring-kv) + q, out and state buffers on one device."""
    tokens = shape.shard_tokens(gpus) if method != "local" else shape.seq_len
    kv = shape.kv_bytes(tokens)
    qo = 2 * shape.batch * shape.heads * shape.head_dim * shape.element_bytes
    state = shape.state_bytes()
    if method == "ring-kv":
        return 2 * kv + qo + state  # eq. 8: the block being received sits beside the own shard
    if method == "allreduce":
        return kv + qo + 2 * shape.batch * shape.heads * STATE_ELEMENT_BYTES  # eq. 9 (n, d, m)
    if method == "onepass":
        return kv + qo + (shape.batch * shape.heads * (shape.dv + 1) + 1) * ONEPASS_ELEMENT_BYTES
    return kv + qo + state


def _method_cost(cluster: Cluster, shape: DecodeShape, gpus: int, devices: int, method: str, tokens: int, attn: float,
                 merge: float, state: int) -> tuple[float, CommCost, float, float | None]:
    """One decode step of `method` before the busy-round and step-overhead terms: (compute seconds,
    the combine's CommCost, seconds, the paper's communication volume in elements or None)."""
    paper: float | None = None
    if method == "local" or devices == 1:
        compute, comm = attn, NO_COMM
        seconds = compute
    elif method == "allreduce":
        comm = allreduce_combine(cluster, shape, gpus)
        compute = attn + merge  # rescale and divide
        seconds = compute + comm.seconds
        paper = volumes.tree_volume_elements(shape, gpus)
    elif method == "onepass":
        comm = onepass_combine(cluster, shape, gpus)
        comm = CommCost(comm.seconds + cluster.host_read_seconds, comm.rounds, comm.bytes_sent, comm.algorithm)
        compute = attn + merge  # scale, then divide
        seconds = compute + comm.seconds
    elif method == "tree":
        members = list(range(gpus))
        up = binomial_reduce(cluster, members, state)
        down = binomial_broadcast(cluster, members, state)
        # the root sends in every broadcast round and is the busiest rank
        comm = CommCost(up.seconds + down.seconds, up.rounds + down.rounds, down.bytes_sent, "binomial")
        compute = attn + up.rounds * merge
        seconds = compute + comm.seconds
    elif method == "twolevel":
        members = node_members(cluster, gpus)
        intra_up = binomial_reduce(cluster, members, state)
        heads = leaders(cluster, gpus)
        across = allreduce_combine(cluster, shape, len(heads)) if len(heads) > 1 else NO_COMM
        intra_down = chain_broadcast(cluster, members, state)
        total = _sum_costs([intra_up, across, intra_down])
        # the leader is the busiest rank: it sends in the leaders' allreduces and the broadcast
        comm = CommCost(total.seconds, total.rounds, across.bytes_sent + intra_down.bytes_sent, "twolevel")
        compute = attn + intra_up.rounds * merge + (merge if len(heads) > 1 else 0.0)
        seconds = compute + comm.seconds
    elif method == "ring-kv":
        lengths = ring_allgather(cluster, gpus, RING_METADATA_BYTES)
        block = shape.kv_bytes(tokens)
        step = ring_pass(cluster, gpus, block)
        hidden = cluster.p2p_overlap * min(attn, step.seconds)
        step_seconds = attn + step.seconds - hidden
        compute = gpus * attn + merge
        seconds = lengths.seconds + (gpus - 1) * step_seconds + attn + merge
        comm = CommCost(
            lengths.seconds + (gpus - 1) * (step.seconds - hidden),
            1 + (gpus - 1),  # comm_stats: the allgather is one round, each p2p step one
            lengths.bytes_sent + (gpus - 1) * block,
            "ring-allgather+ring-p2p",
        )
        paper = volumes.ring_volume_elements(shape, gpus)
    else:  # ring-q
        step = ring_pass(cluster, gpus, state)
        compute = attn + merge
        comm = CommCost((gpus - 1) * step.seconds, gpus - 1, (gpus - 1) * state, "ring-p2p")
        seconds = compute + comm.seconds

    return compute, comm, seconds, paper


def predict_decode(cluster: Cluster, shape: DecodeShape, gpus: int, method: str) -> Prediction:
    """Predict one decode step of `method` with the KV cache of `shape` split over `gpus` devices.

    Raises ValueError for an unknown method, gpus that do not fill whole nodes, or a cache with
    fewer tokens than devices (every device must hold at least one token).
    """
    check_method(method)
    cluster.nodes(gpus)  # validates gpus against gpus_per_node
    devices = 1 if method == "local" else gpus
    if method != "local" and shape.seq_len < gpus:
        raise ValueError(
            f"seq_len ({shape.seq_len}) must be >= gpus ({gpus}) for method {method!r}: "
            f"every device holds at least one token of the sharded KV cache"
        )
    tokens = shape.shard_tokens(devices)
    attn = attention_seconds(cluster, shape, tokens, devices)
    merge = merge_seconds(cluster, devices)
    state = shape.state_bytes()
    compute, comm, seconds, paper = _method_cost(cluster, shape, gpus, devices, method, tokens, attn, merge, state)

    busy_rounds = busy_round_seconds(cluster, gpus, method)
    if busy_rounds > 0:
        comm = CommCost(comm.seconds + busy_rounds, comm.rounds, comm.bytes_sent, comm.algorithm)
        seconds += busy_rounds
    seconds += cluster.step_overhead
    steps = comm.rounds
    if method in ("allreduce", "onepass", "twolevel"):
        steps = _latency_steps(cluster, shape, gpus, method)
    rounds = _comm_stats_rounds(cluster, gpus, method, comm)
    prediction = Prediction(
        method=method,
        gpus=gpus,
        devices=devices,
        seq_len=shape.seq_len,
        predicted_seconds=seconds,
        bytes=comm.bytes_sent,
        rounds=rounds,
        steps=steps,
        compute_seconds=compute,
        comm_seconds=comm.seconds,
        paper_elements=paper,
        peak_memory_bytes=_peak_memory_bytes(shape, method, gpus),
        algorithm=comm.algorithm,
    )
    if cluster.memory_capacity is not None:
        prediction = replace(prediction, fits_memory=memory_shortfall(cluster, prediction) is None)
    return prediction


def rounds_after_attention(cluster: Cluster, gpus: int, method: str) -> list[tuple[str, bool]]:
    """The communication rounds one decode step issues after attention on the critical path, in
    order, as (kind, follows_attention): kind "p2p" (a send/recv step) or "collective" (one
    collective call); follows_attention is True for a round issued right after an attention call
    and False for one issued back to back after another round. What the busy-round terms are
    charged for, as the timed benchmark runs the methods (check_inputs=False):

        allreduce  two collectives: allreduce(max) of lse, then allreduce(sum) of the packed state
        tree       ceil(log2 p) binomial reduce rounds, then ceil(log2 p) broadcast rounds (p2p)
        twolevel   the binomial reduce inside a node (p2p), the leaders' two allreduces (if
                   there is more than one node), one broadcast collective inside a node
        ring-kv    p - 1 p2p steps, each after the attention of a block (the allgather of the
                   shard lengths comes before the attention)
        ring-q     p - 1 p2p steps back to back after the one attention
    """
    if method == "local" or gpus == 1:
        return []
    if method == "ring-kv":
        return [("p2p", True)] * (gpus - 1)
    if method == "allreduce":
        kinds = ["collective", "collective"]
    elif method == "onepass":
        kinds = ["collective"]
    elif method == "tree":
        depth = math.ceil(math.log2(gpus))
        kinds = ["p2p"] * (2 * depth)
    elif method == "twolevel":
        members = node_members(cluster, gpus)
        kinds = ["p2p"] * binomial_reduce(cluster, members, 1.0).rounds
        kinds += ["collective", "collective"] if len(leaders(cluster, gpus)) > 1 else []
        kinds += ["collective"] if len(members) > 1 else []
    else:  # ring-q
        kinds = ["p2p"] * (gpus - 1)
    return [(kind, i == 0) for i, kind in enumerate(kinds)]


def busy_round_seconds(cluster: Cluster, gpus: int, method: str) -> float:
    """Extra seconds of the busy-round terms for one decode step of `method` on `gpus` ranks
    sharing a host: each round of rounds_after_attention costs the first-round figure of its
    kind if it follows the attention, else the next-round figure. 0 on the GPU presets."""
    first = dict(zip(("p2p", "collective"), cluster.busy_round_seconds(gpus)))
    then = dict(zip(("p2p", "collective"), cluster.busy_next_round_seconds(gpus)))
    return sum(first[kind] if follows else then[kind] for kind, follows in rounds_after_attention(cluster, gpus, method))


def _latency_steps(cluster: Cluster, shape: DecodeShape, gpus: int, method: str) -> int:
    """Sequential message latencies inside the allreduce-based methods."""
    if method == "allreduce":
        return allreduce_combine(cluster, shape, gpus).rounds
    if method == "onepass":
        return onepass_combine(cluster, shape, gpus).rounds
    members = node_members(cluster, gpus)
    heads = leaders(cluster, gpus)
    across = allreduce_combine(cluster, shape, len(heads)).rounds if len(heads) > 1 else 0
    return binomial_reduce(cluster, members, 1.0).rounds + across + chain_broadcast(cluster, members, 1.0).rounds


def _comm_stats_rounds(cluster: Cluster, gpus: int, method: str, comm: CommCost) -> int:
    """Rounds as ta.comm_stats counts them: one per collective call or p2p step."""
    if method == "local" or gpus == 1:
        return 0
    if method == "allreduce":
        return 2
    if method == "onepass":
        return 1
    if method == "twolevel":
        members = node_members(cluster, gpus)
        up = binomial_reduce(cluster, members, 1.0).rounds
        broadcast = 1 if len(members) > 1 else 0
        return up + (2 if len(leaders(cluster, gpus)) > 1 else 0) + broadcast
    return comm.rounds


# ------------------------------------------------------------------------------ generation


def prefill_seconds(cluster: Cluster, shape: DecodeShape, gpus: int) -> float:
    """Causal ring-attention prefill of seq_len tokens over `gpus` devices (one layer).

    Each device holds N / p queries and keys; in each of p steps it attends its queries to one
    K, V block (half the blocks are fully masked on average: causal work is half of N^2) while the
    block moves on; transfers overlap with compute by p2p_overlap. FLOPs-bound roofline.
    """
    tokens = shape.shard_tokens(gpus)
    flops_per_block = 2 * shape.batch * shape.heads * tokens * tokens * (shape.head_dim + shape.dv)
    causal_blocks = (gpus + 1) / 2  # a rank attends on average to half the blocks (+ its own diagonal)
    block_time = cluster.kernel_overhead + flops_per_block / (cluster.peak_flops * cluster.flops_efficiency)
    block_time *= _host_slowdown(cluster, gpus)
    if gpus == 1:
        return block_time * 0.5 + cluster.kernel_overhead
    step = ring_pass(cluster, gpus, shape.kv_bytes(tokens))
    step_time = block_time + step.seconds - cluster.p2p_overlap * min(block_time, step.seconds)
    return causal_blocks * block_time + (gpus - 1) * max(0.0, step_time - block_time)


@dataclass(frozen=True)
class GenerationPrediction:
    """Prefill of seq_len prompt tokens, then `new_tokens` decode steps, over `layers` layers."""

    method: str
    gpus: int
    seq_len: int
    new_tokens: int
    layers: int
    prefill_seconds: float
    decode_seconds: float
    predicted_seconds: float

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


def predict_generation(
    cluster: Cluster, shape: DecodeShape, gpus: int, method: str, new_tokens: int, layers: int = 1
) -> GenerationPrediction:
    """Attention time of prefill (ring attention, the same for every method) plus `new_tokens`
    decode steps of `method`, the cache growing by one token per step; times `layers`.

    Only attention is priced: projections, MLPs and sampling are not in the model.
    """
    if not isinstance(new_tokens, int) or new_tokens < 0:
        raise ValueError(f"new_tokens must be an int >= 0, got {new_tokens!r}")
    if not isinstance(layers, int) or layers < 1:
        raise ValueError(f"layers must be an int >= 1, got {layers!r}")
    prefill_devices = 1 if method == "local" else gpus
    prefill = prefill_seconds(cluster, shape, prefill_devices)
    decode = 0.0
    for i in range(new_tokens):
        step_shape = DecodeShape(
            seq_len=shape.seq_len + i,
            heads=shape.heads,
            head_dim=shape.head_dim,
            batch=shape.batch,
            kv_heads=shape.kv_heads,
            value_dim=shape.value_dim,
            dtype=shape.dtype,
        )
        decode += predict_decode(cluster, step_shape, gpus, method).predicted_seconds
    return GenerationPrediction(
        method=method,
        gpus=gpus,
        seq_len=shape.seq_len,
        new_tokens=new_tokens,
        layers=layers,
        prefill_seconds=layers * prefill,
        decode_seconds=layers * decode,
        predicted_seconds=layers * (prefill + decode),
    )


def speedup(cluster: Cluster, shape: DecodeShape, gpus: int, fast: str = "allreduce", slow: str = "ring-kv") -> float:
    """predicted_seconds(slow) / predicted_seconds(fast)."""
    t_fast = predict_decode(cluster, shape, gpus, fast).predicted_seconds
    t_slow = predict_decode(cluster, shape, gpus, slow).predicted_seconds
    return t_slow / t_fast if t_fast > 0 else math.inf
