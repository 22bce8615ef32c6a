"""CPU cost of one shared-memory collective of the Helix layout's decode step, without waiting for a peer.

    python benchmarks/helix_collectives.py

A SharedMemoryGroup of 2 ranks over an anonymous mapping in this one process, the other rank's sequence
number set far ahead so that a collective never waits: what is timed (thread CPU time, the best of 5
batches of 5,000 calls, so a loaded machine's preemption does not count) is the collective's own work on
one rank, the cost it adds per call beyond the ranks' skew. Shapes of Llama-3.2-1B at batch 1:

    (1, 1, 2048) float32        an o_proj or MLP all-reduce (two a layer in the Helix layout)
    32 x 65 float64             the onepass combine's packed state of 32 heads (T=1 on 2 ranks: one a layer)
    16 x 65 float64             half of it: what Helix's all-to-all would send a peer instead
"""

from __future__ import annotations

import mmap
import time

import torch
import torch.distributed as dist

from treeattn.parallel.shared_memory import _LINE, SharedMemoryGroup


def main() -> None:
    capacity = 1 << 18
    mapping = mmap.mmap(-1, 2 * _LINE + 2 * 2 * capacity)
    group = SharedMemoryGroup(None, mapping, rank=0, size=2, capacity_bytes=capacity, timeout_s=10)
    memoryview(mapping).cast("q")[_LINE // 8] = 1 << 60  # rank 1 is always ahead: no collective waits
    cases = (("o_proj / MLP all-reduce, (1, 1, 2048) float32", torch.zeros(1, 1, 2048)),
             ("onepass combine state, 32 x 65 float64", torch.zeros(32 * 65, dtype=torch.float64)),
             ("an all-to-all's half, 16 x 65 float64", torch.zeros(16 * 65, dtype=torch.float64)))
    for name, x in cases:
        best = float("inf")
        for _ in range(5):
            start = time.thread_time()
            for _ in range(5000):
                group.all_reduce(x, dist.ReduceOp.SUM)
            best = min(best, (time.thread_time() - start) / 5000)
        print(f"{name}: {best * 1e6:.1f} us CPU a call ({x.numel() * x.element_size()} bytes)")


if __name__ == "__main__":
    main()
