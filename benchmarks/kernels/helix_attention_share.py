"""One rank's share of Llama-3.2-1B's decode attention in each 2-rank layout: the paged CPU kernel alone.

    python benchmarks/kernels/helix_attention_share.py --context 8192 16384 --dtypes float16 fp8_e4m3 \
        --threads 1 2 --output docs/data/x.json

Issue #47's 16K row: Llama-3.2-1B's attention (8 KV heads of 4 query heads, head dim 64, 16 layers) over a
context of N tokens costs a rank of `--tp 2` 4 KV heads x N keys and a rank of the sequence-only layout 8 KV heads
x N / 2 keys: the same K/V bytes. This script times treeattn.ops.paged_cpu_kernel on exactly those shares ("tp2"
and "seq"), and on the whole (8 heads x N keys, "whole", what one process or llama.cpp reads), over 16 distinct
layers' arenas (one decode query, blocks of 256, every key visible), with 1 and 2 threads (`--threads`: numba's
threads, the blocks split in that many ranges as the engine splits them).

Every round runs, in turn: the roof (one thread streaming a large array of the dtype's element from memory and
summing it: float32, int16 and uint8 sums) and every case. Medians over `--repeats` rounds of the calling
thread's CPU time (1 thread) or the process's CPU time (2 threads: both threads' work) and of wall time, per
layer call; GB/s are the K/V bytes a call must read (with fp8's scales) over that time. "llama.cpp" is the rate
its decode implies from session 16's quiet 16K row: 66 ms a token more for 12,288 more tokens, 16 layers of
float16 K/V (2,048 bytes a token and layer), 2 threads: 6.1 GB/s. With --baseline FILE (another
paged_cpu_kernel.py), that kernel runs beside this one on the same arenas in every round.
"""

from __future__ import annotations

import importlib.util
import os
import statistics
import sys
import time

import numba
import numpy as np
import torch

from treeattn.bench import harness
from treeattn.ops import paged_cpu_kernel as kernel
from treeattn.ops.cpu_decode import kernel_splits
from treeattn.ops.fp8 import quantize_fp8

BS = 256
LAYERS = 16
HKV, G, D = 8, 4, 64
LLAMA_CPP_GBPS = 12288 * LAYERS * 2 * HKV * D * 2 / 0.066 / 1e9
DTYPES = ("float16", "bfloat16", "float32", "fp8_e4m3")
ELEMENT = {"float32": 4, "bfloat16": 2, "float16": 2, "fp8_e4m3": 1}


@numba.njit(cache=True, fastmath=True)
def _sum(x):  # pragma: no cover - compiled
    s = np.float32(0.0)
    for i in range(x.shape[0]):
        s += np.float32(x[i])
    return s


def shares(context: int) -> dict[str, tuple[int, int]]:
    """(KV heads, keys) a rank reads in each layout at `context` tokens, and the whole layer's."""
    return {"tp2": (HKV // 2, context), "seq": (HKV, context // 2), "whole": (HKV, context)}


def arenas(dtype: str, hkv: int, keys: int, seed: int) -> list[tuple]:
    """LAYERS distinct (k, v, k_scales, v_scales) arenas (keys / BS, BS, hkv, D) as the kernel reads them."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(LAYERS):
        kv = [torch.randn(keys // BS, BS, hkv, D, generator=g) for _ in range(2)]
        if dtype == "fp8_e4m3":
            (kc, ks), (vc, vs) = (quantize_fp8(x) for x in kv)
            out.append((kc.view(torch.uint8).numpy(), vc.view(torch.uint8).numpy(), ks.numpy(), vs.numpy()))
            continue
        bits = {"float32": torch.float32, "bfloat16": torch.uint16, "float16": torch.int16}[dtype]
        out.append(tuple(x.to(getattr(torch, dtype)).view(bits).numpy() for x in kv) + (kernel.NO_SCALES,) * 2)
    return out


def kv_bytes(dtype: str, hkv: int, keys: int) -> int:
    return 2 * keys * hkv * (D * ELEMENT[dtype] + (4 if dtype == "fp8_e4m3" else 0))


def load_kernel(path: str):
    spec = importlib.util.spec_from_file_location("paged_cpu_kernel_baseline", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def case(module, layer_arenas, hkv: int, keys: int, threads: int):
    """fn() running the kernel once over every layer's arena."""
    nb = keys // BS
    q = np.random.default_rng(0).standard_normal((1, hkv, G, D)).astype(np.float32)
    table = np.arange(nb, dtype=np.int64).reshape(1, nb)
    kv_pos = np.arange(nb * BS, dtype=np.int64).reshape(1, -1)
    row_seq, q_pos = np.zeros(1, np.int64), np.array([nb * BS], np.int64)
    out, lse = np.empty((1, hkv, G, D), np.float32), np.empty((1, hkv, G), np.float32)
    splits = kernel_splits(threads, 1, nb)

    def run():
        for k, v, ks, vs in layer_arenas:
            module.attend(threads, q, k, v, ks, vs, D, D ** -0.5, table, kv_pos, row_seq, q_pos, 0, splits, out, lse)

    return run


def timed(fn, threads: int) -> tuple[float, float]:
    clock = time.thread_time if threads == 1 else time.process_time
    c, w = clock(), time.perf_counter()
    fn()
    return clock() - c, time.perf_counter() - w


def main() -> None:
    parser = harness.parser(__doc__, context=[8192, 16384], threads=[1, 2], repeats=5)
    parser.add_argument("--dtypes", nargs="+", default=["float16", "fp8_e4m3"], choices=DTYPES, help="stored K/V dtypes")
    parser.add_argument("--layouts", nargs="+", default=["tp2", "seq", "whole"], choices=["tp2", "seq", "whole"])
    parser.add_argument("--baseline", metavar="FILE", help="another paged_cpu_kernel.py to run beside this one")
    parser.add_argument("--roof-bytes", type=int, default=1 << 30, help="bytes of each roof array")
    args = harness.parse_args(parser)
    modules = {"": kernel} | ({"baseline ": load_kernel(args.baseline)} if args.baseline else {})
    roof = {f"roof {t.__name__}": (lambda a=np.ones(args.roof_bytes // np.dtype(t).itemsize, t): _sum(a), args.roof_bytes, 1)
            for t in (np.float32, np.int16, np.uint8)}
    fns = dict(roof)
    for context in args.context:
        for layout in args.layouts:
            hkv, keys = shares(context)[layout]
            for i, dtype in enumerate(args.dtypes):
                layer_arenas = arenas(dtype, hkv, keys, seed=i)
                for threads in args.threads:
                    for prefix, module in modules.items():
                        fns[f"{prefix}{layout} {context} {dtype} t{threads}"] = (
                            case(module, layer_arenas, hkv, keys, threads), kv_bytes(dtype, hkv, keys) * LAYERS, LAYERS)
    load = [os.getloadavg()]
    for fn, _, _ in fns.values():
        fn()
    cpu, wall = {n: [] for n in fns}, {n: [] for n in fns}
    for _ in range(args.repeats):
        for name, (fn, _, _) in fns.items():
            threads = int(name.rsplit("t", 1)[1]) if " t" in name else 1
            c, w = timed(fn, threads)
            cpu[name].append(c)
            wall[name].append(w)
        load.append(os.getloadavg())
    top = args.roof_bytes / statistics.median(cpu["roof float32"]) / 1e9
    rows, lines = {}, [f"llama.cpp implied attention rate (2 threads): {LLAMA_CPP_GBPS:.2f} GB/s; load {load}"]
    for name, (_, nbytes, calls) in fns.items():
        c, w = statistics.median(cpu[name]), statistics.median(wall[name])
        row = {"cpu_s": cpu[name], "wall_s": wall[name], "bytes": nbytes, "ms_per_call_cpu": 1e3 * c / calls,
               "ms_per_call_wall": 1e3 * w / calls, "cpu_GBps": nbytes / c / 1e9, "wall_GBps": nbytes / w / 1e9}
        row["of_roof"] = row["cpu_GBps"] / top
        row["wall_over_llama_cpp_rate"] = row["wall_GBps"] / LLAMA_CPP_GBPS
        if name.startswith("baseline "):
            this = name.removeprefix("baseline ")
            rows[this]["over_baseline_cpu"] = statistics.median(cpu[this]) / c  # this kernel's time / the baseline's
        rows[name] = row
    for name, row in rows.items():
        lines.append(f"{name:34s} {row['ms_per_call_cpu']:7.3f} ms cpu/call {row['ms_per_call_wall']:7.3f} ms wall/call "
                     f"{row['cpu_GBps']:6.2f} GB/s cpu {row['wall_GBps']:6.2f} GB/s wall {row['of_roof']:5.2f} of roof "
                     f"{row['wall_over_llama_cpp_rate']:5.2f}x llama.cpp's rate"
                     + (f"  {row['over_baseline_cpu']:.3f}x baseline's cpu" if "over_baseline_cpu" in row else ""))
    print("\n".join(lines))
    harness.write_output(args.output, {"load_average": load, "rows": rows}, text="\n".join(lines) if
                         str(args.output).endswith(".txt") else None)


if __name__ == "__main__":
    main()
