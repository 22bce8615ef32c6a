"""split6 (bfloat16 parts concatenated along k = 3456) against the float32 product, at larger row blocks.

    PYTHONPATH=$PWD/src python3 docs/data/logp21/split6_shapes.py > docs/data/logp21/split6_shapes.txt

1 torch thread, thread CPU time, median of 7 calls, 2 repeats alternated; random values (speed only). "bf32":
float32 in and out under torch.backends.mkldnn.matmul.fp32_precision = "bf16"; "bf16out": bfloat16 in and out (a bound).
"""
import json
import statistics
import time

import torch
import torch.nn.functional as F

torch.set_num_threads(1)
mode = torch.backends.mkldnn.matmul
g = torch.Generator().manual_seed(0)


def t(f, n=7):
    f()
    r = []
    for _ in range(n):
        c = time.thread_time()
        f()
        r.append(time.thread_time() - c)
    return statistics.median(r)


def timed(precision, f):
    mode.fp32_precision = precision
    try:
        return round(t(f) * 1e3, 2)
    finally:
        mode.fp32_precision = "none"


for M, N in ((512, 2048), (2048, 512), (4096, 256), (2048, 2048)):
    x = torch.randn(M, 576, generator=g)
    w = torch.randn(N, 576, generator=g) * 0.05
    x6 = torch.randn(M, 3456, generator=g).bfloat16().float()
    w6 = (torch.randn(N, 3456, generator=g) * 0.05).bfloat16().float()
    x6b, w6b = x6.bfloat16(), w6.bfloat16()
    row = {"M": M, "N": N, "fp32_ms": [], "split6_bf32_ms": [], "split6_bf16out_ms": []}
    for _ in range(2):
        row["fp32_ms"].append(timed("none", lambda: F.linear(x, w)))
        row["split6_bf32_ms"].append(timed("bf16", lambda: F.linear(x6, w6)))
        row["split6_bf16out_ms"].append(timed("none", lambda: F.linear(x6b, w6b)))
    row["split6_bf32_over_fp32"] = round(sum(row["split6_bf32_ms"]) / sum(row["fp32_ms"]), 3)
    row["split6_bf16out_over_fp32"] = round(sum(row["split6_bf16out_ms"]) / sum(row["fp32_ms"]), 3)
    print(json.dumps(row), flush=True)
