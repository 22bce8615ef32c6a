"""How a rank should read its non-contiguous shard of the engine's block pool (docs/benchmarks.md):
gather the blocks into one (B, keys, Hkv, D) batch and make one attention call, or attend to each
run of physically adjacent blocks (views, no copy) and merge the states with merge_states.

    flock /tmp/treeattn-bench.lock python benchmarks/engine/engine_paged_read.py

One process, one layer (Hq 8, Hkv 2, D 64, float32, block 256 tokens), one decode query per
sequence; times kv_store + attend of treeattn.engine.engine_batch.PagedBatch (the store writes one token
per sequence) with each read, median of --repeats calls, for: a few long sequences whose blocks are
adjacent (one run each: a prefilled document), and many sequences whose blocks are interleaved
(runs of one block: decodes that grew together).
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time

import torch

from treeattn.bench import harness
from treeattn.cache.blocks import BlockRef
from treeattn.cache.paged import PagedKVCache
from treeattn.engine.worker import batch as engine_batch
from treeattn.engine.scheduler import Chunk, StepPlan
from treeattn.models.attention import LocalAttention

HKV, HQ, D, BS = 2, 8, 64, 256


def layout(num_seqs: int, blocks_each: int, interleaved: bool) -> list[list[int]]:
    """Block ids of each sequence: adjacent per sequence, or dealt round-robin across sequences."""
    if interleaved:
        return [[b * num_seqs + s for b in range(blocks_each)] for s in range(num_seqs)]
    return [[s * blocks_each + b for b in range(blocks_each)] for s in range(num_seqs)]


def time_read(cache, tables, copy_free: bool, repeat: int) -> float:
    engine_batch.COPY_FREE_MIN_KEYS = 0 if copy_free else 1 << 40
    chunks = tuple(Chunk(s, (1,), len(t) * BS - 1, tuple(BlockRef(0, i) for i in t), None) for s, t in enumerate(tables))
    plan = StepPlan(chunks)
    batch = engine_batch.PagedBatch(plan, 0, cache, LocalAttention(), combine=(None, "allreduce", 1))
    q = torch.randn(1, len(tables), HQ, D)
    k_new = torch.randn(1, len(tables), HKV, D)
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        k, v, pos = batch.kv_store(0, k_new, k_new)
        batch.attend(q, k, v, q_pos=None, kv_pos=pos, window=None)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = harness.parser(__doc__, repeats=20, threads=1, output=False)
    args = harness.parse_args(parser)
    torch.set_num_threads(args.threads)
    cases = [("1 sequence x 64 blocks (16K keys), adjacent", 1, 64, False),
             ("4 sequences x 16 blocks (4K keys each), adjacent", 4, 16, False),
             ("16 sequences x 4 blocks (1K keys each), interleaved", 16, 4, True),
             ("16 sequences x 16 blocks (4K keys each), interleaved", 16, 16, True)]
    rows = []
    for name, n, blocks, interleaved in cases:
        cache = PagedKVCache(num_layers=1, num_kv_heads=HKV, head_dim=D, num_blocks=n * blocks, block_size=BS)
        cache.arena.normal_()
        tables = layout(n, blocks, interleaved)
        gather = time_read(cache, tables, False, args.repeats)
        runs = time_read(cache, tables, True, args.repeats)
        rows.append({"case": name, "gather_ms": gather * 1e3, "runs_ms": runs * 1e3, "gather_over_runs": gather / runs})
    print(json.dumps({"rows": rows, "threads": args.threads,
                      "machine": f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}"}, indent=2))


if __name__ == "__main__":
    main()
