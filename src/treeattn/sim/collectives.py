"""Latency-bandwidth (alpha-beta) models of the collectives the decoding methods use.

Each function returns a `CommCost`: seconds on the critical path, sequential message steps
(`rounds`), and the bytes the busiest rank sends. Ranks are placed on nodes contiguously: rank r
lives on node r // gpus_per_node, so the ring and the binomial trees below cross nodes exactly
where a real launcher with ranks-per-node blocks would.

NCCL's allreduce picks, per message size, the faster of its ring and tree algorithms; we model
both as NCCL describes them (docs "Collective Operations" and the NCCL tests' bus-bandwidth
notes): the bus-bandwidth term 2 (p - 1) / p x n / B is the same for both, the latency term is
2 (p - 1) steps for the ring and 2 x (chain inside the node + binary tree across nodes) for the
tree.
"""

from __future__ import annotations

from dataclasses import dataclass

from treeattn.sim.hardware import Cluster, Link


@dataclass(frozen=True)
class CommCost:
    """Cost of one communication pattern.

    Attributes:
        seconds: time on the critical path.
        rounds: sequential message steps on the critical path.
        bytes_sent: bytes sent by the busiest rank.
        algorithm: name of the algorithm chosen (e.g. "nccl-ring", "nccl-tree", "binomial").
    """

    seconds: float
    rounds: int
    bytes_sent: float
    algorithm: str

    def __add__(self, other: CommCost) -> CommCost:
        return CommCost(
            self.seconds + other.seconds,
            self.rounds + other.rounds,
            self.bytes_sent + other.bytes_sent,
            f"{self.algorithm}+{other.algorithm}",
        )


NO_COMM = CommCost(0.0, 0, 0.0, "none")


def ceil_log2(n: int) -> int:
    """Smallest k with 2**k >= n (0 for n <= 1)."""
    return 0 if n <= 1 else (n - 1).bit_length()


def slowest_link(cluster: Cluster, ranks: int) -> Link:
    """The link a step that involves all `ranks` (contiguously placed) waits on."""
    return cluster.inter if cluster.nodes(ranks) > 1 else cluster.intra


def pair_link(cluster: Cluster, a: int, b: int) -> Link:
    """The link between ranks a and b."""
    same_node = a // cluster.gpus_per_node == b // cluster.gpus_per_node
    return cluster.intra if same_node else cluster.inter


def p2p_seconds(cluster: Cluster, link: Link, nbytes: float) -> float:
    """One send/recv of `nbytes` over `link`, with the per-call overhead."""
    return cluster.collective_overhead + link.transfer_seconds(nbytes)


def ring_allreduce(cluster: Cluster, ranks: int, nbytes: float) -> CommCost:
    """NCCL ring allreduce of `nbytes` per rank: 2 (p - 1) steps of n / p bytes each."""
    if ranks == 1:
        return CommCost(0.0, 0, 0.0, "nccl-ring")
    link = slowest_link(cluster, ranks)
    steps = 2 * (ranks - 1)
    sent = steps * nbytes / ranks
    seconds = cluster.collective_overhead + steps * link.latency + sent / link.bandwidth
    return CommCost(seconds, steps, sent, "nccl-ring")


def tree_allreduce(cluster: Cluster, ranks: int, nbytes: float) -> CommCost:
    """NCCL tree allreduce: a chain inside each node, a (double) binary tree across nodes,
    reduce up then broadcast down; pipelined, so the bandwidth term equals the ring's."""
    if ranks == 1:
        return CommCost(0.0, 0, 0.0, "nccl-tree")
    nodes = cluster.nodes(ranks)
    chain = min(ranks, cluster.gpus_per_node) - 1
    depth = ceil_log2(nodes)
    latency = 2 * (chain * cluster.intra.latency + depth * cluster.inter.latency)
    link = slowest_link(cluster, ranks)
    sent = 2 * (ranks - 1) / ranks * nbytes
    seconds = cluster.collective_overhead + latency + sent / link.bandwidth
    return CommCost(seconds, 2 * (chain + depth), sent, "nccl-tree")


def nccl_allreduce(cluster: Cluster, ranks: int, nbytes: float) -> CommCost:
    """The faster of NCCL's ring and tree algorithms, as NCCL's tuner picks."""
    ring = ring_allreduce(cluster, ranks, nbytes)
    tree = tree_allreduce(cluster, ranks, nbytes)
    return tree if tree.seconds < ring.seconds else ring


def binomial_reduce(cluster: Cluster, ranks: list[int], nbytes: float) -> CommCost:
    """Reduce to ranks[0] over a binomial tree: in round k, member i with i % 2^(k+1) == 2^k sends
    its partial to member i - 2^k. ceil(log2 n) rounds; each round waits on its slowest pair.
    Every non-root member sends once."""
    n = len(ranks)
    seconds, rounds, stride = 0.0, 0, 1
    while stride < n:
        pairs = [(ranks[i], ranks[i - stride]) for i in range(stride, n, 2 * stride)]
        links = [pair_link(cluster, a, b) for a, b in pairs]
        seconds += max(p2p_seconds(cluster, link, nbytes) for link in links)
        rounds += 1
        stride *= 2
    return CommCost(seconds, rounds, nbytes if n > 1 else 0.0, "binomial-reduce")


def binomial_broadcast(cluster: Cluster, ranks: list[int], nbytes: float) -> CommCost:
    """Broadcast from ranks[0], the binomial reduce run backwards: the root sends in every one of
    the ceil(log2 n) rounds, so it is the busiest rank."""
    up = binomial_reduce(cluster, ranks, nbytes)
    return CommCost(up.seconds, up.rounds, up.rounds * nbytes, "binomial-broadcast")


def ring_allgather(cluster: Cluster, ranks: int, nbytes: float) -> CommCost:
    """Ring allgather of an nbytes piece per rank: p - 1 steps; each rank sends (p - 1) pieces."""
    if ranks == 1:
        return CommCost(0.0, 0, 0.0, "ring-allgather")
    link = slowest_link(cluster, ranks)
    sent = (ranks - 1) * nbytes
    seconds = cluster.collective_overhead + (ranks - 1) * link.latency + sent / link.bandwidth
    return CommCost(seconds, ranks - 1, sent, "ring-allgather")


def all_to_all(cluster: Cluster, ranks: int, nbytes: float) -> CommCost:
    """All-to-all of `nbytes` per rank cut in `ranks` equal pieces, piece j going to rank j (NCCL's
    grouped send/recv, as TensorRT-LLM's Helix all-to-all): the p - 1 messages of a rank leave at once,
    so the step pays one latency, and (p - 1) / p x nbytes pass through each rank's link.

    >>> from treeattn.sim import PRESETS
    >>> cost = all_to_all(PRESETS["gb200-nvl72"], 4, 4000)
    >>> cost.rounds, cost.bytes_sent
    (1, 3000.0)
    """
    if ranks == 1:
        return CommCost(0.0, 0, 0.0, "all-to-all")
    link = slowest_link(cluster, ranks)
    sent = (ranks - 1) / ranks * nbytes
    seconds = cluster.collective_overhead + link.latency + sent / link.bandwidth
    return CommCost(seconds, 1, sent, "all-to-all")


def direct_allreduce(cluster: Cluster, ranks: int, nbytes: float) -> CommCost:
    """All-reduce of `nbytes` per rank among ranks of one node that reach every peer through a switch
    (NVSwitch), as TensorRT-LLM's and vLLM's custom all-reduce run it for small messages, the faster of:
    one-shot (every rank reads every peer's buffer at once and reduces it: one latency, (p - 1) x nbytes
    through its link) and two-shot (a direct reduce-scatter, then a direct all-gather: two latencies,
    2 (p - 1) / p x nbytes). Not NCCL's ring or chain: no p - 1 sequential hops.

    >>> from treeattn.sim import PRESETS
    >>> direct_allreduce(PRESETS["gb200-nvl72"], 64, 4096).algorithm, direct_allreduce(PRESETS["gb200-nvl72"], 64, 32768).algorithm
    ('one-shot', 'two-shot')
    """  # noqa: E501
    if ranks == 1:
        return CommCost(0.0, 0, 0.0, "direct")
    link = cluster.intra
    one = CommCost(cluster.collective_overhead + link.latency + (ranks - 1) * nbytes / link.bandwidth, 1,
                   (ranks - 1) * nbytes, "one-shot")
    sent = 2 * (ranks - 1) / ranks * nbytes
    two = CommCost(cluster.collective_overhead + 2 * link.latency + sent / link.bandwidth, 2, sent, "two-shot")
    return one if one.seconds <= two.seconds else two


def chain_broadcast(cluster: Cluster, ranks: list[int], nbytes: float) -> CommCost:
    """NCCL broadcast from ranks[0]: a pipelined chain, n - 1 hops of latency plus one pass of
    the bytes. The source sends the message once (one collective call: one round)."""
    n = len(ranks)
    if n == 1:
        return CommCost(0.0, 0, 0.0, "chain-broadcast")
    one_node = len({r // cluster.gpus_per_node for r in ranks}) == 1
    link = cluster.intra if one_node else cluster.inter
    seconds = cluster.collective_overhead + (n - 1) * link.latency + nbytes / link.bandwidth
    return CommCost(seconds, n - 1, nbytes, "chain-broadcast")


def ring_pass(cluster: Cluster, ranks: int, nbytes: float) -> CommCost:
    """One step of a ring in which every rank sends `nbytes` to its successor at once; the step
    waits on the slowest hop (the inter-node one when the ring spans nodes)."""
    if ranks == 1:
        return CommCost(0.0, 0, 0.0, "ring-step")
    link = slowest_link(cluster, ranks)
    seconds = cluster.collective_overhead + link.latency + nbytes / link.bandwidth
    return CommCost(seconds, 1, nbytes, "ring-step")


def leaders(cluster: Cluster, ranks: int) -> list[int]:
    """The first rank of every node."""
    return list(range(0, ranks, cluster.gpus_per_node))


def node_members(cluster: Cluster, ranks: int) -> list[int]:
    """The ranks of the first node (every node is alike)."""
    return list(range(min(ranks, cluster.gpus_per_node)))

