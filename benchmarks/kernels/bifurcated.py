"""Bifurcated attention vs a plain batch: one decode step of n samples from one shared context.

    python benchmarks/kernels/bifurcated.py step     # latency, K/V bytes read and peak memory vs n
    python benchmarks/kernels/bifurcated.py switch   # where plain attention beats the split (the "auto" rule)
    python benchmarks/kernels/bifurcated.py summarize run1.json run2.json ...   # several `step --output` runs

step: one attention layer, one decode step (Sq = 1), float32, n samples that have each decoded
Md = 64 tokens after a context of Mc tokens. Shapes: MHA Hq = Hkv = 16, D = 64 (hidden size 1024,
like Pythia-410M or GPT-2 medium); MQA Hq = 16, Hkv = 1, D = 64.

- bifurcated: ta.bifurcated_attention(mode="bifurcated") with the context K/V stored once
  (1, Mc, Hkv, D) and the decoded K/V (n, Md, Hkv, D).
- plain batch: what an engine without bifurcation holds and runs: a cache of n copies of the
  context, each followed by its sample's decoded K/V, (n, Mc + Md, Hkv, D), and one batched
  ta.attention call. The cache is built before timing (it is the engine's state, not per-step
  work).

Times come from one child process per configuration, both layouts called in turn (best of
--repeats), so background load on a shared machine hits both alike. Peak memory comes from one
more fresh child per layout: ru_maxrss minus the resident size before its K/V, query and one
attention call were made (the plain cache is built in place, never next to a separate context).
K/V bytes read per step are the algorithm's minimum: bifurcated (Mc + n * Md) token rows, plain
batch n * (Mc + Md). A plain batch whose cache would exceed --max-cache-gib is not run; its size
is reported instead.

switch: ta.bifurcated_attention's two modes on the same inputs (the switch chooses between them,
so "batched" includes building the concatenated cache, as a fallback must) over small workloads,
interleaved, best of --repeats. Prints the ratio table and the threshold on the number of context
K elements a plain batch reads per step (n * Mc * Hkv * D) with the least summed log slowdown
over the grid (every workload weighs the same).
"""

from __future__ import annotations

import itertools
import json
import math
import os
import platform
import resource
import subprocess
import sys
import time

import torch

import treeattn as ta
from treeattn.bench import harness

VARIANTS = {"MHA": (16, 16, 64), "MQA": (16, 1, 64)}  # (Hq, Hkv, D)
GIB = 1 << 30


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def kv_bytes(tokens: int, Hkv: int, D: int, itemsize: int = 4) -> int:
    return 2 * tokens * Hkv * D * itemsize  # K and V


# ---------------------------------------------------------------- step


def make_inputs(variant: str, Mc: int, n: int, Md: int):
    Hq, Hkv, D = VARIANTS[variant]
    torch.manual_seed(0)
    q = torch.randn(n, 1, Hq, D)
    return q, torch.randn(1, Mc, Hkv, D), torch.randn(1, Mc, Hkv, D), torch.randn(n, Md, Hkv, D), torch.randn(n, Md, Hkv, D)


def plain_cache(context, decode):
    """The plain batch's cache: n copies of the context, each followed by its sample's decoded K/V."""
    return torch.cat([context.expand(decode.shape[0], -1, -1, -1), decode], dim=1)


def time_one(variant: str, Mc: int, n: int, Md: int, repeats: int, with_plain: bool) -> dict:
    """Best-of times of both layouts in one process, calls interleaved so that background load on
    the shared machine hits both alike."""
    q, ck, cv, dk, dv = make_inputs(variant, Mc, n, Md)
    calls = {"bifurcated": lambda: ta.bifurcated_attention(q, ck, cv, dk, dv, mode="bifurcated")}
    if with_plain:
        keys, values = plain_cache(ck, dk), plain_cache(cv, dv)
        calls["plain"] = lambda: ta.attention(q, keys, values)
    return interleaved_best(calls, repeats)


def memory_one(mode: str, variant: str, Mc: int, n: int, Md: int) -> dict:
    """Peak resident memory added by one layout's K/V, query and one attention call."""
    Hq, Hkv, D = VARIANTS[variant]
    baseline = rss_bytes()
    if mode == "bifurcated":
        ta.bifurcated_attention(*make_inputs(variant, Mc, n, Md), mode="bifurcated")
    else:
        # Built in place, as a plain-batch engine holds it: no separate context copy at any time.
        q = torch.randn(n, 1, Hq, D)
        keys, values = torch.empty(n, Mc + Md, Hkv, D), torch.empty(n, Mc + Md, Hkv, D)
        for cache in (keys, values):
            cache[0, :Mc].normal_()
            cache[1:, :Mc] = cache[:1, :Mc]
            cache[:, Mc:].normal_()
        ta.attention(q, keys, values)
    return {"peak_bytes": peak_rss_bytes() - baseline}


def interleaved_best(calls: dict, repeats: int) -> dict:
    """{name: best seconds} over `repeats` rounds, one call of each per round, after a warm-up call."""
    best = dict.fromkeys(calls, float("inf"))
    for fn in calls.values():
        fn()
    for _ in range(repeats):
        for name, fn in calls.items():
            start = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - start)
    return best


def step(args) -> None:
    rows = []
    print(f"# {platform.machine()}, {os.cpu_count()} cores, CPU-only, torch {torch.__version__}, float32, "
          f"{torch.get_num_threads()} threads; Sq = 1, Md = {args.decoded}, best of {args.repeats} interleaved")
    print("| variant | context | n | bifurcated ms | plain batch ms | speedup | KV read bifurcated | KV read plain | "
          "peak mem bifurcated | peak mem plain |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for variant, Mc, n in itertools.product(args.variants, args.context, args.samples):
        Hq, Hkv, D = VARIANTS[variant]
        read_bif = kv_bytes(Mc + n * args.decoded, Hkv, D)
        read_plain = kv_bytes(n * (Mc + args.decoded), Hkv, D)
        fits = read_plain <= args.max_cache_gib * GIB  # the plain cache alone is read_plain bytes
        row = {"variant": variant, "context": Mc, "n": n, "decoded": args.decoded,
               "kv_read_bifurcated": read_bif, "kv_read_plain": read_plain}
        row["seconds"] = _child(["time", variant, Mc, n, args.decoded, args.repeats, int(fits)])
        row["peak_bytes"] = {"bifurcated": _child(["memory", "bifurcated", variant, Mc, n, args.decoded])["peak_bytes"]}
        if fits:
            row["peak_bytes"]["plain"] = _child(["memory", "plain", variant, Mc, n, args.decoded])["peak_bytes"]
        rows.append(row)
        t_bif = row["seconds"]["bifurcated"]
        if fits:
            t_plain = row["seconds"]["plain"]
            plain_cells = f"{t_plain * 1e3:.1f} | {t_plain / t_bif:.1f}x"
            peak_plain = _mib(row["peak_bytes"]["plain"])
        else:
            plain_cells = f"not run: its cache needs {read_plain / GIB:.0f} GiB | –"
            peak_plain = f"> {read_plain / GIB:.0f} GiB"
        print(f"| {variant} | {Mc // 1024}K | {n} | {t_bif * 1e3:.1f} | {plain_cells} | {_mib(read_bif)} | "
              f"{_mib(read_plain)} | {_mib(row['peak_bytes']['bifurcated'])} | {peak_plain} |", flush=True)
    harness.write_output(args.output, rows)


def _mib(nbytes: int) -> str:
    return f"{nbytes / GIB:.2f} GiB" if nbytes >= GIB else f"{nbytes / (1 << 20):.0f} MiB"


def _child(argv: list) -> dict:
    """Run `one ...` in a fresh process (its own peak memory) and return its JSON result."""
    cmd = [sys.executable, __file__, "one", *map(str, argv)]
    result = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(result.stdout)


def summarize(paths: list[str]) -> None:
    """One table from several `step --output` runs: per layout the best time over all runs, the
    speedup from those, and each run's own speedup (the spread on a shared machine). K/V read and
    peak memory come from the last run."""
    runs = []
    for path in paths:
        with open(path) as f:
            runs.append(json.load(f))
    print(f"# best of {len(runs)} runs ({', '.join(paths)}); memory from the last")
    print("| variant | context | n | bifurcated ms | plain batch ms | speedup | speedup per run | KV read bifurcated | "
          "KV read plain | peak mem bifurcated | peak mem plain |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for rows in zip(*runs):
        last = rows[-1]
        t_bif = min(r["seconds"]["bifurcated"] for r in rows)
        if "plain" in last["seconds"]:
            t_plain = min(r["seconds"]["plain"] for r in rows)
            per_run = ", ".join(f"{r['seconds']['plain'] / r['seconds']['bifurcated']:.1f}" for r in rows)
            plain_cells = f"{t_plain * 1e3:.1f} | {t_plain / t_bif:.1f}x | {per_run}"
            peak_plain = _mib(last["peak_bytes"]["plain"])
        else:
            plain_cells = f"not run: its cache needs {last['kv_read_plain'] / GIB:.0f} GiB | – | –"
            peak_plain = f"> {last['kv_read_plain'] / GIB:.0f} GiB"
        print(f"| {last['variant']} | {last['context'] // 1024}K | {last['n']} | {t_bif * 1e3:.1f} | {plain_cells} | "
              f"{_mib(last['kv_read_bifurcated'])} | {_mib(last['kv_read_plain'])} | {_mib(last['peak_bytes']['bifurcated'])} | "
              f"{peak_plain} |")


# ---------------------------------------------------------------- switch


def switch(args) -> None:
    print(f"# {platform.machine()}, {os.cpu_count()} cores, CPU-only, torch {torch.__version__}, float32, Sq = 1, "
          f"best of {args.repeats} interleaved; cell: time(batched) / time(bifurcated), > 1: the split is faster")
    points = []
    for variant in args.variants:
        Hq, Hkv, D = VARIANTS[variant]
        for Md in args.switch_decoded:
            print(f"\n{variant} (Hq={Hq}, Hkv={Hkv}, D={D}), Md = {Md}")
            print("| Mc \\ n | " + " | ".join(str(n) for n in args.switch_samples) + " |")
            print("|---:|" + "---:|" * len(args.switch_samples))
            for Mc in args.switch_contexts:
                cells = []
                for n in args.switch_samples:
                    t_bif, t_bat = _interleaved(Hq, Hkv, D, Mc, n, Md, args.repeats)
                    points.append({"variant": variant, "Mc": Mc, "n": n, "Md": Md, "elements": n * Mc * Hkv * D,
                                   "bifurcated": t_bif, "batched": t_bat})
                    cells.append(f"{t_bat / t_bif:.2f}")
                print(f"| {Mc} | " + " | ".join(cells) + " |", flush=True)
    threshold, (log_slowdown, misses) = fit_threshold(points)
    always_log, always_misses = _loss(points, 0)
    print(f"\nfitted rule: batched iff n * Mc * Hkv * D <= {threshold}. Over the {len(points)} workloads it picks the "
          f"slower mode (by > 5%) {misses} times, mean slowdown vs the faster mode {math.exp(log_slowdown / len(points)):.3f}x; "
          f"always bifurcated: {always_misses} times, {math.exp(always_log / len(points)):.3f}x")
    harness.write_output(args.output, {"points": points, "threshold": threshold})


def _interleaved(Hq, Hkv, D, Mc, n, Md, repeats) -> tuple[float, float]:
    torch.manual_seed(0)
    q = torch.randn(n, 1, Hq, D)
    ck, cv = torch.randn(1, Mc, Hkv, D), torch.randn(1, Mc, Hkv, D)
    dk, dv = torch.randn(n, Md, Hkv, D), torch.randn(n, Md, Hkv, D)
    best = interleaved_best({m: (lambda m=m: ta.bifurcated_attention(q, ck, cv, dk, dv,
                                                                     mode=m)) for m in ("bifurcated", "batched")}, repeats)
    return best["bifurcated"], best["batched"]


def _loss(points, threshold) -> tuple[float, int]:
    """For the rule "batched iff elements <= threshold": the summed log slowdown over the grid
    (log of chosen time / faster time; every workload weighs the same, whatever its size) and the
    number of workloads where the chosen mode is more than 5% slower than the other."""
    log_slowdown, misses = 0.0, 0
    for p in points:
        chosen = p["batched"] if p["elements"] <= threshold else p["bifurcated"]
        best = min(p["batched"], p["bifurcated"])
        log_slowdown += math.log(chosen / best)
        misses += chosen > 1.05 * best
    return log_slowdown, misses


def fit_threshold(points) -> tuple[int, tuple[float, int]]:
    """The threshold (one of the grid's element counts, or 0) with the least summed log slowdown."""
    candidates = sorted({0, *(p["elements"] for p in points)})
    threshold = min(candidates, key=lambda t: (_loss(points, t)[0], t))
    return threshold, _loss(points, threshold)


# ---------------------------------------------------------------- command line


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "one":  # child process of `step`
        if sys.argv[2] == "time":
            variant, Mc, n, Md, repeats, with_plain = sys.argv[3:9]
            result = time_one(variant, int(Mc), int(n), int(Md), int(repeats), bool(int(with_plain)))
        else:
            mode, variant, Mc, n, Md = sys.argv[3:8]
            result = memory_one(mode, variant, int(Mc), int(n), int(Md))
        print(json.dumps(result))
        return
    parser = harness.parser(__doc__, context=[8192, 32768], repeats=5,
                            helps={"context": "context lengths in tokens", "output": "also write the measurements to this file"})
    parser.add_argument("what", choices=["step", "switch", "summarize"])
    parser.add_argument("files", nargs="*", help="summarize: JSON files written by step --output")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--samples", type=int, nargs="+", default=[1, 8, 32, 128])
    parser.add_argument("--decoded", type=int, default=64, help="Md, tokens each sample has decoded")
    parser.add_argument("--max-cache-gib", type=float, default=12.0, help="skip plain batches whose K/V cache exceeds this")
    parser.add_argument("--switch-contexts", type=int, nargs="+", default=[16, 64, 256, 1024, 4096])
    parser.add_argument("--switch-samples", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    parser.add_argument("--switch-decoded", type=int, nargs="+", default=[1, 64])
    args = harness.parse_args(parser)
    if args.what == "summarize":
        summarize(args.files)
    else:
        step(args) if args.what == "step" else switch(args)


if __name__ == "__main__":
    main()
