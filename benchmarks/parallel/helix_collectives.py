"""CPU cost of one shared-memory collective of the Helix layout's decode step, without waiting for a peer,
and of the kernels one rank runs in a decode step at 4K (--kernels).

    python benchmarks/parallel/helix_collectives.py [--kernels]

A SharedMemoryGroup of 2 ranks over an anonymous mapping in this one process, the other rank's sequence
number set far ahead so that a collective never waits: what is timed (thread CPU time, the best of 5
batches of 5,000 calls, so a loaded machine's preemption does not count) is the collective's own work on
one rank, the cost it adds per call beyond the ranks' skew. Shapes of Llama-3.2-1B at batch 1:

    (1, 1, 2048) float32        an o_proj or MLP all-reduce (two a layer in the Helix layout)
    32 x 65 float64             the onepass combine's packed state of 32 heads (T=1 on 2 ranks: one a layer)
    16 x 65 float64             half of it: what Helix's all-to-all would send a peer instead

--kernels: one torch thread, thread CPU time (best of 5): the packed Q4_0 matmuls of one T=2 rank's 16
layers (q 1024 x 2048, k and v 256 x 2048, o_proj 2048 x 1024, gate and up 4096 x 2048, down 2048 x 4096:
random blocks) and of its LM head share (64128 x 2048), and decode attention over 16 layers of a float32
and a bfloat16 cache for one query: a T=2 rank (16 query / 4 KV heads, 4096 keys), a sequence-only rank
(32 / 8 heads, 2048 keys) and one process (32 / 8 heads, 4096 keys). These are the step's kernels alone;
what a measured step takes beyond them is Python, norms, RoPE, cache writes and waiting for the peer.
"""

from __future__ import annotations

import mmap
import sys
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


def _cpu_ms(fn, repeats: int = 5) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.thread_time()
        fn()
        best = min(best, time.thread_time() - start)
    return 1e3 * best


def kernels() -> None:
    import treeattn as ta
    from treeattn.ops.packed_linear import kernel_arrays, packed_matmul

    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)

    def matmul(n: int, k: int):
        qs, d = torch.randint(0, 256, (n, k // 32, 16), dtype=torch.uint8, generator=gen), torch.rand(n, k // 32, generator=gen)
        x, arrays = torch.randn(1, 1, k, generator=gen), kernel_arrays(qs, d, None)
        return lambda: packed_matmul(x, "q4_0", qs, d, None, arrays=arrays)

    layer = [matmul(n, k) for n, k in ((1024, 2048), (256, 2048), (256, 2048), (2048, 1024), (4096, 2048), (4096, 2048),
                                       (2048, 4096))]
    one_layer = sum(_cpu_ms(f, 20) for f in layer)
    print(f"T=2 rank, packed Q4_0 matmuls of 16 layers: {16 * one_layer:.1f} ms CPU; LM head share: "
          f"{_cpu_ms(matmul(64128, 2048)):.1f} ms CPU")
    for name, (hq, hkv, sk) in {"T=2 rank": (16, 4, 4096), "sequence-only rank": (32, 8, 2048),
                                "one process": (32, 8, 4096)}.items():
        for dtype in (torch.float32, torch.bfloat16):
            q = torch.randn(1, 1, hq, 64, generator=gen).to(dtype)
            k, v = (torch.randn(1, sk, hkv, 64, generator=gen).to(dtype) for _ in range(2))
            q_pos, kv_pos = torch.tensor([[sk - 1]]), torch.arange(sk)[None]
            ms = _cpu_ms(lambda: [ta.attention(q, k, v, causal=True, q_pos=q_pos, kv_pos=kv_pos) for _ in range(16)])
            print(f"{name}, decode attention of 16 layers ({hq} / {hkv} heads, {sk} keys, {str(dtype)[6:]}): {ms:.1f} ms CPU")


if __name__ == "__main__":
    main()
    if "--kernels" in sys.argv[1:]:
        kernels()
