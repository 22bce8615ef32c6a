"""Decode-step latency of sequence-parallel attention on gloo CPU ranks: tree vs ring.

    flock /tmp/treeattn-bench.lock python benchmarks/retired/decode_cpu.py [--nproc 2 4]
        [--seq-lens 16384 65536 262144] [--repeats 7] [--ring-repeats 3] [--output results.json]
    python benchmarks/retired/decode_cpu.py --render results.json    # the tables again, from the samples

One decode step (B = 1, Sq = 1, Hq = Hkv = 16, D = 128, float32; the paper's benchmark block) with
the KV cache of N tokens split evenly over p ranks, each rank a process on this machine:

- tree allreduce / tree tree / tree twolevel: ta.tree_decode with each method (twolevel with
  Topology(ranks_per_node=2): one node at p = 2, two nodes at p = 4);
- ring pass-KV, ring pass-Q: ta.ring_decode(pass_kv=True / False);
- single process: ta.attention over the whole cache in one process using every core (the other
  ranks wait in a barrier);
- floor: the slowest rank's local attention (all ranks computing at once) + one allreduce of
  b*d + b*Hq floats: what any exact sequence-parallel decode must pay;
- K/V read (GEMV): every rank reads its K and V once with a matrix-vector product, all at once:
  the memory-bandwidth floor under the local attention.

Each rank runs torch.set_num_threads(1): the machine has 2 cores shared by the p ranks, so more
threads per rank only oversubscribe. Timing is barrier-aligned: every call starts with a
barrier, each rank times its call, and the step time is the slowest rank's; the methods take
turns call by call (so background load hits them alike) and the table gives the median over the
repeats, after one warm-up call each. All calls use treeattn's defaults, so the tree methods
include the cross-rank input check (one small all-gather).

Peak memory: for one call of tree allreduce and of ring pass-KV, each rank resets its peak RSS
(/proc/self/clear_refs) and reports VmHWM minus the RSS before the call: the memory the step
needs beyond its inputs. It is compared with the paper's eq. 8-9 (ring 4btd + 2bd, tree
2btd + 2bd + 2bHq elements, which include the inputs q and the local K/V, 2btd + bd).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch
import torch.distributed as dist

import treeattn as ta
from treeattn.bench.runner import PeakMemory

HEADS, HEAD_DIM = 16, 128


def slowest(seconds: float) -> float:
    """Max over ranks (outside any timed region)."""
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def timed_interleaved(methods: dict, repeats: dict) -> dict[str, list[float]]:
    """Slowest-rank seconds of barrier-aligned calls, the methods taking turns (round r runs each
    method that still needs samples once), so that load from other users of the machine falls on
    all methods alike. One warm-up call each first."""
    for fn in methods.values():
        fn()
    samples = {name: [] for name in methods}
    for round_ in range(max(repeats.values())):
        for name, fn in methods.items():
            if round_ >= repeats[name]:
                continue
            dist.barrier()
            start = time.perf_counter()
            fn()
            samples[name].append(slowest(time.perf_counter() - start))
    return samples


def peak_extra_bytes(fn) -> int:
    """Max over ranks of (peak RSS during fn) - (RSS before fn), bytes."""
    dist.barrier()
    with PeakMemory(torch.device("cpu")) as memory:
        fn()
    return int(slowest(float(memory.peak_bytes or 0)))


def bench_rank(rank: int, p: int, seq_lens: list[int], repeats: int, ring_repeats: int) -> list[dict] | None:
    torch.set_num_threads(1)
    rows = []
    for N in seq_lens:
        t = N // p
        gen = torch.Generator().manual_seed(0)
        q = torch.randn(1, 1, HEADS, HEAD_DIM, generator=gen)
        row = {"p": p, "N": N, "t": t, "times": {}, "memory": {}}

        # single process over the whole cache: rank 0 with every core, the others idle in a barrier
        if rank == 0:
            torch.set_num_threads(2)
            k_all = torch.randn(1, N, HEADS, HEAD_DIM, generator=gen)
            v_all = torch.randn(1, N, HEADS, HEAD_DIM, generator=gen)
            ta.attention(q, k_all, v_all)
            samples = []
            for _ in range(repeats):
                start = time.perf_counter()
                ta.attention(q, k_all, v_all)
                samples.append(time.perf_counter() - start)
            row["times"]["single process (2 threads)"] = samples
            del k_all, v_all
            torch.set_num_threads(1)
        dist.barrier()

        gen.manual_seed(1000 + rank)
        k = torch.randn(1, t, HEADS, HEAD_DIM, generator=gen)
        v = torch.randn(1, t, HEADS, HEAD_DIM, generator=gen)
        small = torch.zeros(HEADS * HEAD_DIM + HEADS)
        weights = torch.randn(HEADS * HEAD_DIM, generator=gen)
        methods = {
            "tree allreduce": lambda: ta.tree_decode(q, k, v, method="allreduce"),
            "tree tree": lambda: ta.tree_decode(q, k, v, method="tree"),
            "tree twolevel": lambda: ta.tree_decode(q, k, v, method="twolevel", topology=ta.Topology(ranks_per_node=2)),
            "ring pass-Q": lambda: ta.ring_decode(q, k, v, pass_kv=False),
            "ring pass-KV": lambda: ta.ring_decode(q, k, v, pass_kv=True),
            "local attention": lambda: ta.attention(q, k, v),
            "one small allreduce": lambda: dist.all_reduce(small),
            # every K and V byte read once (a matrix-vector product per tensor): the bandwidth floor
            "K/V read (GEMV)": lambda: (k.view(t, -1).mv(weights), v.view(t, -1).mv(weights)),
        }
        row["times"].update(
            timed_interleaved(methods, {name: ring_repeats if name == "ring pass-KV" else repeats for name in methods})
        )
        row["bytes_sent"] = {}
        for name in ("tree allreduce", "ring pass-KV"):
            with ta.comm_stats() as stats:
                row["memory"][name] = peak_extra_bytes(methods[name])
            row["bytes_sent"][name] = stats.bytes_sent
        k = v = None
        rows.append(row)
    return rows if rank == 0 else None


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f}"


def mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:.1f}"


COLUMNS = ["tree allreduce", "tree tree", "tree twolevel", "ring pass-Q", "ring pass-KV",
           "single process (2 threads)", "local attention", "one small allreduce", "K/V read (GEMV)"]


def markdown(rows: list[dict]) -> str:
    """Median ms per method and (p, N); floor = slowest local attention + one small allreduce."""
    lines = [
        "| p | N | " + " | ".join(COLUMNS) + " | floor | ring pass-KV / tree allreduce | tree allreduce / floor |",
        "|---|---|" + "---:|" * (len(COLUMNS) + 3),
    ]
    for row in rows:
        med = {name: statistics.median(samples) for name, samples in row["times"].items()}
        floor = med["local attention"] + med["one small allreduce"]
        cells = [ms(med[name]) for name in COLUMNS] + [ms(floor)]
        ratios = [f"{med['ring pass-KV'] / med['tree allreduce']:.1f}", f"{med['tree allreduce'] / floor:.2f}"]
        lines.append(f"| {row['p']} | {row['N'] // 1024}K | " + " | ".join(cells + ratios) + " |")
    lines += [
        "",
        "Peak memory per rank during one step above its inputs (RSS high-water mark minus RSS before the",
        "call; max over ranks), beside the paper's eq. 8-9 (b = 1, d = Hq * D = 2048, t = N / p, float32).",
        "Eq. 8-9 count the inputs (q and the local K/V: 2btd + bd) too; the columns subtract them.",
        "",
        "| p | N | tree measured KiB | eq. 9 minus inputs (bd + 2bHq) KiB | ring pass-KV measured MiB | eq. 8 minus inputs "
        "(2btd + bd) MiB | double-buffered ring (2 blocks if p > 2) MiB | eq. 9 MiB | eq. 8 MiB |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        b, d, t, h, item = 1, HEADS * HEAD_DIM, row["t"], HEADS, 4
        tree_extra = (b * d + 2 * b * h) * item
        ring_extra = (2 * b * t * d + b * d) * item
        ring_double = ((4 if row["p"] > 2 else 2) * b * t * d + b * d) * item
        tree_total = (2 * b * t * d + 2 * b * d + 2 * b * h) * item
        ring_total = (4 * b * t * d + 2 * b * d) * item
        lines.append(
            f"| {row['p']} | {row['N'] // 1024}K | {row['memory']['tree allreduce'] / 1024:.0f} | {tree_extra / 1024:.0f} | "
            f"{mib(row['memory']['ring pass-KV'])} | {mib(ring_extra)} | {mib(ring_double)} | {mib(tree_total)} | "
            f"{mib(ring_total)} |"
        )
    lines += [
        "",
        "Bytes each rank sent in one step (comm_stats; allreduce counted as 2 (p-1)/p x payload), beside",
        "eq. 14 (tree: 2 (p-1)/p (bd + 2bHq) elements) and eq. 10 (ring: 2btd elements per rank and step,",
        "p - 1 steps), float32. The tree's figure also holds the input check (one all-gather of 14 int64).",
        "",
        "| p | N | tree allreduce sent B | eq. 14 B | ring pass-KV sent MiB | eq. 10 per rank (p-1) 2btd MiB |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for row in rows:
        p, b, d, t, h, item = row["p"], 1, HEADS * HEAD_DIM, row["t"], HEADS, 4
        eq14 = 2 * (p - 1) / p * (b * d + 2 * b * h) * item
        eq10 = (p - 1) * 2 * b * t * d * item
        lines.append(
            f"| {p} | {row['N'] // 1024}K | {row['bytes_sent']['tree allreduce']:.0f} | {eq14:.0f} | "
            f"{mib(row['bytes_sent']['ring pass-KV'])} | {mib(eq10)} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nproc", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[16384, 65536, 262144])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--ring-repeats", type=int, default=3, help="repeats of ring pass-KV (seconds per call at 256K)")
    parser.add_argument("--output", type=str, default=None, help="write the raw samples here")
    parser.add_argument("--render", type=str, default=None, help="print the tables of an earlier --output file and exit")
    args = parser.parse_args()
    if args.render:
        with open(args.render) as f:
            saved = json.load(f)
        print(f"machine: {saved['machine']}")
        print(markdown(saved["rows"]))
        return
    for p in args.nproc:
        for N in args.seq_lens:
            if N % p:
                parser.error(f"N={N} must be divisible by p={p}")
    rows = []
    started = time.time()
    for p in args.nproc:
        rows += ta.spawn(bench_rank, p, args.seq_lens, args.repeats, args.ring_repeats, timeout=900)[0]
    machine = f"{platform.machine()}, {torch.get_num_threads()} threads available, torch {torch.__version__}"
    print(f"machine: {machine}; wall time {time.time() - started:.0f} s")
    print(markdown(rows))
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"machine": machine, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
