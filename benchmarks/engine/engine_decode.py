"""Per-token decode latency of the demo model on local CPU ranks: tree vs ring (docs/benchmarks.md).

    flock /tmp/treeattn-bench.lock python benchmarks/engine/engine_decode.py --context 65536 --nproc 4

The demo model (treeattn.eval.synthetic.DEMO_CONFIG: random weights, 2 layers, hidden 128, 4 query / 2 KV
heads of 32, float32) is prefilled once with a synthetic prompt of --context tokens on --nproc gloo
ranks (ring prefill, contiguous placement); then --max-new-tokens tokens are decoded greedily with each
method from that same cache. Reported per method: median / p10 / p90 of rank 0's decode step time
(a step = one token through the model + sampling + broadcast of the id), bytes sent per step by all
ranks together and sequential communication rounds per step (treeattn's comm_stats), KV bytes per
rank, and how much resident memory a rank gained during decoding (max over ranks).

With --gather-check it also times, on one process, what a block table would cost: attention over
one rank's shard read as a view of the arena (what ShardedKVCache does) vs gathering the shard's
blocks through a shuffled block table first (what a paged pool needs before a dense kernel).
"""

from __future__ import annotations

import platform
import statistics
import time

import torch

import treeattn as ta
from treeattn.bench import harness
from treeattn.eval.synthetic import DEMO_CONFIG, run_demo, run_reference

METHODS = (("tree", "allreduce"), ("tree", "tree"), ("ring", "allreduce"))


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def decode_rows(context: int, nproc: int, new_tokens: int, reference: bool) -> list[dict]:
    runs, sharded_s = run_demo(context=context, nproc=nproc, new_tokens=new_tokens, methods=METHODS)
    if reference:
        runs.append(run_reference(context=context, new_tokens=new_tokens))
    rows = []
    for run in runs:
        res = run.result
        steps = res.step_times_s
        rows.append({
            "method": run.name,
            "ranks": run.world_size,
            "median_ms": 1e3 * statistics.median(steps),
            "p10_ms": 1e3 * quantile(steps, 0.1),
            "p90_ms": 1e3 * quantile(steps, 0.9),
            "comm_bytes_per_step": res.comm_bytes_per_token,
            "rounds_per_step_rank0": res.comm.get("rounds", 0) / res.decode_steps,
            "kv_mib_per_rank": max(res.kv_bytes_per_rank) / 2**20,
            "decode_rss_growth_mib": max(0, max(p - s for p, s in zip(res.peak_rss_bytes_per_rank,
                                                                      res.start_rss_bytes_per_rank))) / 2**20,
            "tokens": res.generated_ids[0],
            "time_to_first_token_s": res.prefill_s,
        })
    same = all(row["tokens"] == rows[0]["tokens"] for row in rows)
    print(f"# sharded run {sharded_s:.1f} s incl. process start; all methods give the same tokens: {same}")
    return rows


def gather_check(shard_tokens: int, block_size: int, repeats: int) -> dict:
    """One rank's decode attention for one layer: view of the arena vs gather through a block table."""
    cfg = DEMO_CONFIG
    torch.set_num_threads(1)
    blocks = shard_tokens // block_size
    arena_k = torch.randn(1, blocks * block_size, cfg["num_kv_heads"], cfg["head_dim"])
    arena_v = torch.randn_like(arena_k)
    q = torch.randn(1, 1, cfg["num_heads"], cfg["head_dim"])
    table = torch.randperm(blocks)  # a pool hands out blocks in any order

    def view():
        return ta.attention(q, arena_k, arena_v)

    def gathered():
        k = arena_k.view(blocks, block_size, *arena_k.shape[2:]).index_select(0, table).view_as(arena_k)
        v = arena_v.view(blocks, block_size, *arena_v.shape[2:]).index_select(0, table).view_as(arena_v)
        return ta.attention(q, k, v)

    timings = {}
    for name, fn in (("view", view), ("gather", gathered)):
        fn()
        samples = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - start)
        timings[name] = 1e3 * statistics.median(samples)
    return {"shard_tokens": shard_tokens, "block_size": block_size, "view_ms": timings["view"],
            "gather_then_attend_ms": timings["gather"]}


def main() -> None:
    parser = harness.parser(__doc__, context=65536, nproc=4, max_new_tokens=16,
                            helps={"output": "write the rows to this file"})
    parser.add_argument("--reference", action="store_true", help="also decode on one process (its own prefill)")
    parser.add_argument("--gather-check", action="store_true")
    args = harness.parse_args(parser)

    machine = f"{platform.machine()}, {torch.get_num_threads()} threads available, torch {torch.__version__}"
    print(f"# {machine}; context {args.context}, {args.nproc} ranks, {args.max_new_tokens} new tokens")
    rows = decode_rows(args.context, args.nproc, args.max_new_tokens, args.reference)
    print("| method | ranks | decode step median (p10-p90) | comm per step, all ranks | rounds per step (rank 0) | KV per rank "
          "| RSS growth while decoding |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['method']} | {r['ranks']} | {r['median_ms']:.1f} ms ({r['p10_ms']:.1f}-{r['p90_ms']:.1f}) | "
              f"{r['comm_bytes_per_step'] / 2**10:,.1f} KiB | {r['rounds_per_step_rank0']:.0f} | {r['kv_mib_per_rank']:.1f} MiB "
              f"| "
              f"{r['decode_rss_growth_mib']:.1f} MiB |")
    result = {"machine": machine, "args": vars(args), "rows": rows}
    if args.gather_check:
        check = gather_check(args.context // args.nproc, 256, 30)
        print(f"# one rank, one layer, {check['shard_tokens']} tokens, blocks of {check['block_size']}: attention on the arena "
              f"view "
              f"{check['view_ms']:.2f} ms; gather through a block table + attention {check['gather_then_attend_ms']:.2f} ms")
        result["gather_check"] = check
    harness.write_output(args.output, result)


if __name__ == "__main__":
    main()
