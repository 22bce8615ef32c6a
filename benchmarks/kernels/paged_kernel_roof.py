"""The CPU paged decode kernel against this host's single-thread memory roof.

    python benchmarks/kernels/paged_kernel_roof.py --context 4096 16384 --output docs/data/x.json

The roof: one thread summing a large array in a numba loop (float32, and int16 widened), read once
from memory (--roof-bytes, far beyond the caches). The kernel: treeattn.ops.paged_cpu_kernel on one
thread over `layers` distinct layers' K and V arenas (30, or as many as --max-bytes of float32 holds:
always far beyond the last-level cache), one decode query, `context` visible keys, blocks of 256, for
each model's attention shape (--heads) and each stored dtype (float32, bfloat16, float16, fp8_e4m3
with its float32 scale per key and head). Its achieved bandwidth is the K and V bytes it must read
(with fp8's scales) over its time.

Every round runs the roof sums and every dtype's kernel once, in turn (a machine whose load drifts
weighs on all of them); --repeats rounds; medians of thread CPU time (time.thread_time) and wall
time are reported, per token of the measured layers and scaled to 30 layers. "hot" repeats one
layer --hot-layers times over the same arena (in cache when it fits: the kernel's compute alone).
With --baseline FILE (another version of src/treeattn/ops/paged_cpu_kernel.py, e.g. from
`git show REV:src/treeattn/ops/paged_cpu_kernel.py > /tmp/old_kernel.py`), that kernel runs beside
this one in every round, on the same arenas: "baseline" rows, and their ratio to this kernel.
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
from treeattn.ops.fp8 import quantize_fp8

BS = 256
MODEL_LAYERS = 30
HEADS = {"smollm2": (3, 3, 64), "gemma3-270m": (1, 4, 256), "llama3.2-1b": (8, 4, 64)}  # Hkv, G, D
DTYPES = ("float32", "bfloat16", "float16", "fp8_e4m3")


@numba.njit(cache=True, fastmath=True)
def sum_float32(x):  # pragma: no cover - compiled
    s = np.float32(0.0)
    for i in range(x.shape[0]):
        s += x[i]
    return s


@numba.njit(cache=True, fastmath=True)
def sum_int16(x):  # pragma: no cover - compiled
    s = np.int32(0)
    for i in range(x.shape[0]):
        s += np.int32(x[i])
    return s


def timed(fn) -> tuple[float, float]:
    """(thread CPU seconds, wall seconds) of fn()."""
    c, w = time.thread_time(), time.perf_counter()
    fn()
    return time.thread_time() - c, time.perf_counter() - w


def arenas(dtype: str, hkv: int, d: int, nb: int, layers: int, seed: int) -> list[tuple]:
    """`layers` distinct (k, v, k_scales, v_scales) arenas (nb, BS, hkv, d) as the kernel reads them."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(layers):
        kv = [torch.randn(nb, BS, hkv, d, generator=g) for _ in range(2)]
        if dtype == "fp8_e4m3":
            (kc, ks), (vc, vs) = (quantize_fp8(x) for x in kv)
            out.append((kc.view(torch.uint8).numpy(), vc.view(torch.uint8).numpy(), ks.numpy(), vs.numpy()))
            continue
        bits = {"float32": torch.float32, "bfloat16": torch.uint16, "float16": torch.int16}[dtype]
        k, v = (x.to(getattr(torch, dtype)).view(bits).numpy() for x in kv)
        out.append((k, v, kernel.NO_SCALES, kernel.NO_SCALES))
    return out


def kv_bytes(dtype: str, hkv: int, d: int, keys: int) -> int:
    """The K and V bytes a query reads over `keys` keys (fp8: with its scales)."""
    per = {"float32": 4, "bfloat16": 2, "float16": 2, "fp8_e4m3": 1}[dtype]
    return 2 * keys * hkv * (d * per + (4 if dtype == "fp8_e4m3" else 0))


def load_kernel(path: str):
    """A paged_cpu_kernel module loaded from a file (its own numba cache beside it)."""
    spec = importlib.util.spec_from_file_location("paged_cpu_kernel_baseline", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # numba's cache of its kernels imports it by name
    spec.loader.exec_module(module)
    return module


def kernel_case(heads: str, context: int, max_bytes: int, hot_layers: int, baseline=None, dtypes=DTYPES):
    """The calls of one (heads, context) case: {name: (fn, bytes read per call)}."""
    hkv, grp, d = HEADS[heads]
    nb = context // BS
    layers = max(2, min(MODEL_LAYERS, max_bytes // kv_bytes("float32", hkv, d, nb * BS)))
    q = np.random.default_rng(0).standard_normal((1, hkv, grp, d)).astype(np.float32)
    table = np.arange(nb, dtype=np.int64).reshape(1, nb)
    kv_pos = np.arange(nb * BS, dtype=np.int64).reshape(1, -1)
    row_seq, q_pos = np.zeros(1, np.int64), np.array([nb * BS], np.int64)
    out, lse = np.empty((1, hkv, grp, d), np.float32), np.empty((1, hkv, grp), np.float32)
    fns = {}
    for i, dtype in enumerate(DTYPES):
        if dtype not in dtypes:
            continue
        layer_arenas = arenas(dtype, hkv, d, nb, layers, seed=i)

        def run(todo, module):
            for k, v, ks, vs in todo:
                module.attend(1, q, k, v, ks, vs, d, d ** -0.5, table, kv_pos, row_seq, q_pos, 0, 1, out, lse)

        per_call = kv_bytes(dtype, hkv, d, nb * BS)
        for prefix, module in (("", kernel), ("baseline ", baseline)):
            if module is None:
                continue
            fns[f"{prefix}{dtype} cold"] = (lambda a=layer_arenas, run=run, m=module: run(a, m), per_call * layers, layers)
            fns[f"{prefix}{dtype} hot"] = (lambda a=layer_arenas[:1] * hot_layers, run=run, m=module: run(a, m),
                                           per_call * hot_layers, hot_layers)
    return fns


def measure(fns: dict, repeats: int) -> dict:
    """Every fn once per round, in turn, `repeats` rounds (after one warm-up round): medians."""
    for fn, _, _ in fns.values():
        fn()
    cpu = {n: [] for n in fns}
    wall = {n: [] for n in fns}
    for _ in range(repeats):
        for name, (fn, _, _) in fns.items():
            c, w = timed(fn)
            cpu[name].append(c)
            wall[name].append(w)
    rows = {}
    for name, (_, nbytes, calls) in fns.items():
        c, w = statistics.median(cpu[name]), statistics.median(wall[name])
        rows[name] = {"bytes": nbytes, "calls": calls, "cpu_s": cpu[name], "wall_s": wall[name],
                      "cpu_GBps": nbytes / c / 1e9, "wall_GBps": nbytes / w / 1e9,
                      "cpu_ms_per_30_layers": 1e3 * c * MODEL_LAYERS / calls if "roof" not in name else None}
    return rows


def main() -> None:
    parser = harness.parser(__doc__, context=[4096, 16384], repeats=7)
    parser.add_argument("--heads", nargs="+", default=list(HEADS), choices=list(HEADS), help="models' attention shapes")
    parser.add_argument("--roof-bytes", type=int, default=1 << 30, help="bytes of each roof array")
    parser.add_argument("--max-bytes", type=int, default=1 << 30, help="float32 K/V bytes of a case at most")
    parser.add_argument("--hot-layers", type=int, default=30, help="calls over one layer's arena for 'hot'")
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES), help="stored dtypes")
    parser.add_argument("--baseline", metavar="FILE", help="another paged_cpu_kernel.py to run beside this one")
    args = harness.parse_args(parser)
    baseline = load_kernel(args.baseline) if args.baseline else None
    load = [os.getloadavg()]
    roof_f32 = np.ones(args.roof_bytes // 4, np.float32)
    roof_i16 = np.ones(args.roof_bytes // 2, np.int16)
    roof = {"roof float32 sum": (lambda: sum_float32(roof_f32), roof_f32.nbytes, 1),
            "roof int16 sum": (lambda: sum_int16(roof_i16), roof_i16.nbytes, 1)}
    results = []
    for heads in args.heads:
        for context in args.context:
            case = kernel_case(heads, context, args.max_bytes, args.hot_layers, baseline, args.dtypes)
            rows = measure({**roof, **case}, args.repeats)
            load.append(os.getloadavg())
            top = rows["roof float32 sum"]["cpu_GBps"]
            for name, row in rows.items():
                row["of_roof_float32"] = row["cpu_GBps"] / top
                if name.startswith("baseline "):  # this kernel's median time over the baseline's
                    this = rows[name.removeprefix("baseline ")]
                    this["over_baseline"] = row["cpu_GBps"] / this["cpu_GBps"]
            results.append({"heads": heads, "hkv_g_d": HEADS[heads], "context": context, "rows": rows})
            print(f"== {heads} (Hkv, G, D = {HEADS[heads]}), {context} keys, load {os.getloadavg()[0]:.2f}")
            for name, row in rows.items():
                print(f"{name:18s} cpu {row['cpu_GBps']:6.1f} GB/s  wall {row['wall_GBps']:6.1f} GB/s  "
                      f"{row['of_roof_float32']:5.2f} of roof  {1e3 * statistics.median(row['cpu_s']):7.2f} ms cpu"
                      + (f"  {row['over_baseline']:.3f}x baseline's time" if "over_baseline" in row else ""))
    harness.write_output(args.output, {"load_average": load, "results": results})


if __name__ == "__main__":
    main()
