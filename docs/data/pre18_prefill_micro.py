"""Session 18 (pre18), prefill micro-benchmarks on one thread (thread CPU time): the packed weights' dequantization
before and after d413819, and torch's float32 vs bfloat16 GEMM for a 512-row prefill chunk through Gemma 3 270M's
fused gate/up matrix (4096 x 640).

    PYTHONPATH=src python3 docs/data/pre18_prefill_micro.py
"""
import time

import torch

from treeattn.ops.packed_linear import dequantize_packed

torch.set_num_threads(1)


def concatenated(fmt, qs, d, m):  # dequantize_packed before d413819
    q = qs.to(torch.float32) if fmt == "q8_0" else torch.cat((qs & 15, qs >> 4), dim=-1).to(torch.float32)
    if fmt == "q4_0":
        q -= 8.0
    w = q * d[..., None]
    if m is not None:
        w += m[..., None]
    return w.reshape(*qs.shape[:-2], -1)


def ms(f, n=10):
    f()
    start = time.thread_time()
    for _ in range(n):
        f()
    return (time.thread_time() - start) / n * 1e3


N, K, M = 4096, 640, 512
g = torch.Generator().manual_seed(0)
qs = torch.randint(0, 256, (N, K // 32, 16), dtype=torch.uint8, generator=g)
q16 = torch.randint(-2000, 2000, (N, K // 32, 32), dtype=torch.int16, generator=g)
d, m = torch.rand(N, K // 32, generator=g), torch.rand(N, K // 32, generator=g)
for fmt, q, off in (("q4_1", qs, m), ("q8_0 (int16: Q6_K)", q16, None)):
    f = fmt.split()[0]
    same = torch.equal(concatenated(f, q, d, off), dequantize_packed(f, q, d, off))
    print(f"dequantize {fmt} {N}x{K}: before {ms(lambda: concatenated(f, q, d, off)):.2f} ms, "
          f"after {ms(lambda: dequantize_packed(f, q, d, off)):.2f} ms, bit-identical {same}")
x, w = torch.randn(M, K, generator=g), torch.randn(N, K, generator=g)
for dtype in (torch.float32, torch.bfloat16):
    t = ms(lambda: torch.nn.functional.linear(x.to(dtype), w.to(dtype)), 20)
    print(f"F.linear {M}x{K} @ {K}x{N} in {dtype}: {t:.2f} ms, {2 * M * K * N / t / 1e6:.1f} GFLOPS on one thread, the casts of x and W included")
