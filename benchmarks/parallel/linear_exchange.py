"""Sequence-parallel linear attention: the two state exchanges, all-gather vs log2(p) scan.

    python benchmarks/parallel/linear_exchange.py [--nproc 2 3 4] [--tokens 2048] [--repeats 20]

Each rank holds tokens/p tokens of one sequence (B = 1, Hq = 9, Hkv = 3, D = Dv = 64: a SmolLM2
layer; Hedgehog F = 128). Timed per method: the exchange alone (the state of this rank's chunk ->
incoming and total state) and the whole causal prefill call (return_state=True). Every rank times
the same calls after a barrier; the figure is the median over repeats of the slowest rank.
"""

from __future__ import annotations

import json
import statistics
import time

import torch
import torch.distributed as dist

import treeattn as ta
from treeattn.bench import harness
from treeattn.linear import HedgehogFeatureMap, LinearAttentionState
from treeattn.linear.exchange import exchange_states


def worker(rank: int, world: int, tokens: int, repeats: int) -> dict:
    torch.set_num_threads(1)
    n = tokens // world
    g = torch.Generator().manual_seed(rank)
    q, k, v = torch.randn(1, n, 9, 64, generator=g), torch.randn(1, n, 3, 64, generator=g), torch.randn(1, n, 3, 64, generator=g)
    fm = HedgehogFeatureMap(3, 64)
    local = LinearAttentionState(torch.randn(1, 3, 128, 64), torch.rand(1, 3, 128))
    zero = LinearAttentionState.zeros(1, 3, 128, 64)
    results = {}
    with torch.no_grad():
        for method in ("allgather", "scan"):
            for what, fn in (
                ("exchange", lambda: exchange_states(local, zero, dist.group.WORLD, method=method, need_incoming=True,
                                                     need_total=True)),
                ("prefill", lambda: ta.linear_attention(q, k, v, feature_map=fm, group=dist.group.WORLD, method=method,
                                                        return_state=True)),
            ):
                times = []
                for i in range(repeats + 2):
                    dist.barrier()
                    start = time.perf_counter()
                    fn()
                    elapsed = torch.tensor([time.perf_counter() - start])
                    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
                    if i >= 2:
                        times.append(elapsed.item())
                results[f"{what}/{method}"] = statistics.median(times)
    return results


def main() -> None:
    parser = harness.parser(__doc__, nproc=[2, 3, 4], repeats=20, output=False)
    parser.add_argument("--tokens", type=int, default=2048)
    args = harness.parse_args(parser)
    rows = []
    for world in args.nproc:
        r = ta.spawn(worker, world, args.tokens, args.repeats)[0]
        rows.append({"p": world, **{key: round(value * 1e3, 3) for key, value in r.items()},
                     "exchange scan/allgather": round(r["exchange/scan"] / r["exchange/allgather"], 2),
                     "prefill scan/allgather": round(r["prefill/scan"] / r["prefill/allgather"], 2)})
        print(json.dumps(rows[-1]), flush=True)


if __name__ == "__main__":
    main()
