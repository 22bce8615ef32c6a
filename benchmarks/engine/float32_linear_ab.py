"""float32 x @ W.T on the CPU by MKL (F.linear), oneDNN's matmul, and oneDNN's matmul of a prepacked weight, alternated.

    python3 benchmarks/engine/float32_linear_ab.py --repeats 9

For each ROWSxKxN shape (rows of x, the reduced dimension, the weight's rows): random float32 operands, then
per repeat each variant in turn (the order rotated from repeat to repeat) runs the product enough times for
~0.1 s of one thread's CPU (time.thread_time; one torch thread), so that a loaded machine moves all variants
alike. Variants: "mkl" F.linear (MKL's sgemm), "onednn" torch.ops.mkldnn._linear_pointwise with the plain
weight (ops.dense_linear's oneDNN path), "onednn_prepacked" the same with the weight reordered once into
oneDNN's blocked layout (torch.ops.mkldnn._reorder_linear_weight(W, ROWS)). The default shapes: SmolLM2's LM
head by 2048-column chunks (512x576x2048, prompt logprobs) and its layers' prefill products for 512-token
chunks (q, k/v, gate/up, down). Prints one JSON object: GFLOPS per repeat, per shape the median of each
variant's per-repeat ratio to mkl, the CPU (/proc/cpuinfo "model name"), torch's CPU capability, the load
average at the start and the end.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F


def cpu_model() -> str:
    """/proc/cpuinfo's first "model name" ("" where there is none)."""
    with open("/proc/cpuinfo") as f:
        return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=["512x576x2048", "512x576x576", "512x576x192",
                                                        "512x576x1536", "512x1536x576"])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--seconds", type=float, default=0.1, help="CPU seconds a variant runs per repeat (about)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    load_start = open("/proc/loadavg").read().split()[:3]
    g = torch.Generator().manual_seed(0)
    gflops, ratios = {}, {}
    for shape in args.shapes:
        rows, k, n = (int(v) for v in shape.split("x"))
        x, w = torch.randn(rows, k, generator=g), torch.randn(n, k, generator=g) * 0.05
        packed = torch.ops.mkldnn._reorder_linear_weight(w, rows)
        variants = {"mkl": lambda: F.linear(x, w),
                    "onednn": lambda: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], ""),
                    "onednn_prepacked": lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")}
        flop = 2 * rows * k * n
        start = time.thread_time()
        calls = 0
        while time.thread_time() - start < args.seconds:
            variants["mkl"]()
            calls += 1
        names = list(variants)
        runs = {name: [] for name in names}
        for r in range(args.repeats):
            for name in names[r % len(names):] + names[: r % len(names)]:
                start = time.thread_time()
                for _ in range(calls):
                    variants[name]()
                runs[name].append(round(calls * flop / (time.thread_time() - start) / 1e9, 1))
        gflops[shape] = runs
        ratios[shape] = {name: round(statistics.median(a / b for a, b in zip(runs[name], runs["mkl"])), 3)
                         for name in names[1:]}
    print(json.dumps({"cpu": cpu_model(), "capability": torch.backends.cpu.get_cpu_capability(),
                      "torch": torch.__version__, "gflops": gflops, "median_ratio_to_mkl": ratios,
                      "loadavg_start": load_start, "loadavg_end": open("/proc/loadavg").read().split()[:3]}, indent=1))


if __name__ == "__main__":
    main()
