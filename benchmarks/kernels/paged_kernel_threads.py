"""The paged CPU kernel on 1 and on 2 threads at short contexts: where a second thread starts to pay.

    python3 benchmarks/kernels/paged_kernel_threads.py [--rounds 3] [--calls 300]

One decode row of SmolLM2's heads (9 query heads, 3 KV heads, head_dim 64) over float16 blocks of 16 slots, at
64-4,096 positions; each round times both thread counts at every context (wall microseconds a call, the mean of
--calls calls after 20 warm-up calls). Prints the machine's load average: on a machine with other work a parallel
call waits for a descheduled worker, and that is part of what this measures. It sets the threads explicitly, so
it times the kernel as cpu_decode.kernel_threads would not choose it below PARALLEL_MIN_SLOTS.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from treeattn.ops.paged_decode import PagedDecodeLayout, layer_call

CONTEXTS = (64, 256, 512, 1024, 2048, 4096)


def time_call(ctx: int, threads: int, calls: int, BS: int = 16, Hq: int = 9, Hkv: int = 3, D: int = 64) -> float:
    """Microseconds a call of the kernel over `ctx` positions on `threads` threads."""
    nb = ctx // BS
    k, v = torch.randn(nb, BS, Hkv, D).half(), torch.randn(nb, BS, Hkv, D).half()
    q = torch.randn(1, 1, Hq, D)
    layout = PagedDecodeLayout(torch.arange(nb)[None], torch.arange(nb * BS)[None], torch.tensor([[ctx - 1]]),
                               block_size=BS, threads=threads)
    call = layer_call(q, k, v, layout)
    for _ in range(20):
        call(q, k, v, None)
    start = time.perf_counter()
    for _ in range(calls):
        call(q, k, v, None)
    return (time.perf_counter() - start) / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--calls", type=int, default=300)
    args = parser.parse_args()
    torch.set_num_threads(2)
    times: dict[tuple[int, int], list[float]] = {}
    for _ in range(args.rounds):
        for ctx in CONTEXTS:
            for threads in (1, 2):
                times.setdefault((ctx, threads), []).append(time_call(ctx, threads, args.calls))
    print(f"load average after: {os.getloadavg()}; torch threads 2; rounds {args.rounds}, {args.calls} calls each")
    for ctx in CONTEXTS:
        one, two = (" ".join(f"{t:8.1f}" for t in times[(ctx, n)]) for n in (1, 2))
        print(f"{ctx:5d} positions   1 thread us: {one}   2 threads us: {two}")


if __name__ == "__main__":
    main()
