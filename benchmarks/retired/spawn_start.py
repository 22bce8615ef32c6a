"""What a rank process costs to start: `ta.spawn(pow, 2, 10)` with forked ranks against spawned ones.

    flock /tmp/treeattn-quiet.lock python benchmarks/retired/spawn_start.py [--repeats 3]

Each round runs `repeats` spawns of 2 ranks of one torch thread, forked (ta.spawn's default for
such ranks on Linux) and then spawned (method="spawn": a fresh interpreter that imports torch and
treeattn), twice over so that both see the same machine load. CPU seconds are this process's and its
waited-for children's (getrusage), per rank; wall seconds per spawn. The function is a builtin, so a
spawned rank imports no module of the caller's: a test's rank also imports its test module.
"""

from __future__ import annotations

import argparse
import resource
import time

import torch

import treeattn as ta


def cpu_seconds() -> float:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="spawns of 2 ranks per round and method")
    args = parser.parse_args()
    torch.ones(512, 512) @ torch.ones(512, 512)  # this process has run an OpenMP parallel region, as a test process has
    for method in ("fork", "spawn", "fork", "spawn"):
        cpu, wall = cpu_seconds(), time.perf_counter()
        for _ in range(args.repeats):
            assert ta.spawn(pow, 2, 10, threads=1, method=method) == [0, 1]
        cpu, wall = cpu_seconds() - cpu, time.perf_counter() - wall
        print(f"{method}: {args.repeats} spawns of 2 ranks: {cpu / (2 * args.repeats):.2f} CPU-s per rank, "
              f"{wall / args.repeats:.2f} s wall per spawn", flush=True)


if __name__ == "__main__":
    main()
