"""Across ranks (torch.distributed): sequence-parallel decoding and prefill over a sharded KV cache.

    tree_decode      exact decode attention, partial states combined in O(log p) rounds
    ring_decode      the ring baselines: K/V shards travel (pass_kv=True) or partial states do
    ring_attention   causal prefill, every rank with its own query chunk, K/V rotating
    comm_stats       what each rank communicated (bytes, messages, rounds, per op)
    spawn            run a function on every rank of a fresh process group
    Topology         ranks per node, for the topology-aware tree
"""

from treeattn.parallel.comm import CommStats, OpStats, comm_stats
from treeattn.parallel.ring import ring_attention, ring_decode
from treeattn.parallel.spawn import SpawnError, spawn
from treeattn.parallel.topology import Topology
from treeattn.parallel.tree_decode import tree_decode

__all__ = [
    "CommStats",
    "OpStats",
    "SpawnError",
    "Topology",
    "comm_stats",
    "ring_attention",
    "ring_decode",
    "spawn",
    "tree_decode",
]
