"""Per-layer cost of each tree_decode combine on local ranks, methods and transports interleaved.

    PYTHONPATH=src python3 benchmarks/parallel/combine_latency.py --nproc 2 4 --tokens 4096 --steps 20

Each rank holds `tokens` keys of one layer (SmolLM2-135M's attention shape by default: 9 query
heads, 3 KV heads of 64, float32). A "step" runs `layers` layers; in each, every rank attends to
its shard (ops.attention) and then the layer's states are combined with ONE (method, transport)
pair, the pairs taking turns layer by layer so that load on a shared machine falls on all of them
alike. Transports: "gloo" (the process group's sockets) and "shm" (treeattn.parallel.shared_memory,
one shared mapping; the default of generate and the engine on one host). The
combine (treeattn.parallel.combine_states: communication and merge) is timed on every rank;
reported: median, p10 and p90 over all layers of all steps, of the slowest rank per layer, and the
rounds comm_stats counted per combine.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

import treeattn as ta
from treeattn.bench import harness
from treeattn.ops import attention
from treeattn.parallel.shared_memory import SharedMemoryGroup
from treeattn.parallel.tree_decode import combine_states


def rank_main(rank: int, world_size: int, args) -> dict | None:
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(rank)
    q = torch.randn(1, 1, args.heads, args.head_dim, generator=torch.Generator().manual_seed(0))
    k = torch.randn(1, args.tokens, args.kv_heads, args.head_dim, generator=g)
    v = torch.randn(1, args.tokens, args.kv_heads, args.head_dim, generator=g)
    groups = {"gloo": None, "shm": SharedMemoryGroup.create(None) if "shm" in args.transports else None}
    variants = [(m, t) for m in args.methods for t in args.transports]
    times = {f"{m} ({t})": [] for m, t in variants}
    rounds = {}
    for step in range(args.steps + 2):
        for layer in range(args.layers):
            method, transport = variants[(step + layer) % len(variants)]
            name = f"{method} ({transport})"
            out, lse = attention(q, k, v)
            with ta.comm_stats() as stats:
                start = time.perf_counter()
                combine_states(out, lse, group=groups[transport], method=method)
                elapsed = time.perf_counter() - start
            rounds[name] = stats.rounds
            if step >= 2:  # warmup
                times[name].append(elapsed)
    slowest = {}
    for m, mine in times.items():
        table = [None] * world_size
        dist.all_gather_object(table, mine)
        slowest[m] = [max(per_rank[i] for per_rank in table) for i in range(len(mine))]
    if rank != 0:
        return None
    report = {}
    for m, values in slowest.items():
        q10, q50, q90 = (statistics.quantiles(values, n=10)[0], statistics.median(values), statistics.quantiles(values, n=10)[-1])
        report[m] = {"median_ms": q50 * 1e3, "p10_ms": q10 * 1e3, "p90_ms": q90 * 1e3, "samples": len(values),
                     "rounds": rounds[m]}
    return report


def main() -> None:
    parser = harness.parser(__doc__, nproc=[2, 4])
    parser.add_argument("--tokens", type=int, default=4096, help="keys per rank")
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--methods", nargs="+", default=["allreduce", "onepass", "tree"])
    parser.add_argument("--transports", nargs="+", default=["gloo", "shm"], choices=["gloo", "shm"])
    args = harness.parse_args(parser)
    results = {}
    for p in args.nproc:
        report = ta.spawn(rank_main, p, args, timeout=600)[0]
        results[p] = report
        for m, r in report.items():
            print(f"p={p} {m:17s} combine per layer: median {r['median_ms']:.3f} ms (p10 {r['p10_ms']:.3f}, p90 "
                  f"{r['p90_ms']:.3f}), "
                  f"{r['rounds']} round(s), {r['samples']} layers")
    harness.write_output(args.output, results)


if __name__ == "__main__":
    main()
