"""A forked rank's first numba kernel call, with and without numba's CPU target made ready before the fork.

    python3 benchmarks/parallel/rank_first_kernel.py [--repeats 3]

What ta.spawn's fork server saves each rank (parallel.fork_server_numba): this process imports torch and
treeattn, optionally fills numba's typing and target contexts (as the fork server does), then forks a child that
runs one paged decode attention through the CPU kernel (numba's cache already holds it: run twice if the first
run compiles). Prints the child's wall and CPU seconds for that first call, alternating the two cases.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

CHILD = r"""
import os, sys, time
import torch, treeattn
if sys.argv[1] == "ready":
    from numba.core.registry import cpu_target
    cpu_target.typing_context.refresh(); cpu_target.target_context.refresh()
r, w = os.pipe()
pid = os.fork()
if pid == 0:
    wall, cpu = time.perf_counter(), time.process_time()
    from treeattn.ops.cpu_decode import decode_attention
    q, k, v = torch.randn(1, 1, 16, 128), torch.randn(1, 1000, 16, 128), torch.randn(1, 1000, 16, 128)
    decode_attention(q, k, v, scale=0.1, q_pos=None, kv_pos=None, window=None)
    os.write(w, f"{time.perf_counter() - wall:.3f} {time.process_time() - cpu:.3f}".encode())
    os._exit(0)
os.waitpid(pid, 0)
print(os.read(r, 100).decode())
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print(f"load average before: {os.getloadavg()}")
    for i in range(args.repeats):
        for case in ("cold", "ready"):
            out = subprocess.run([sys.executable, "-c", CHILD, case], capture_output=True, text=True, check=True).stdout
            wall, cpu = out.split()
            print(f"round {i}: target {case:5s}: the child's first kernel call {float(wall):.3f} s wall, {float(cpu):.3f} s CPU")
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
