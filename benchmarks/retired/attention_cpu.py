"""ta.attention vs torch's scaled_dot_product_attention for one decode step on the CPU.

    python benchmarks/retired/attention_cpu.py [--seq-lens 4096 65536 524288] [--dtype float32] [--repeats 9]

Shapes: B = 1, Sq = 1, Hq = 32, Hkv = 8, D = 128 (a Llama-3-8B layer). Both sides get the cache in
treeattn's layout (B, Sk, Hkv, D); SDPA is also timed on a (B, Hkv, Sk, D) contiguous copy, the
layout it prefers, so the comparison is against its best case too. The roofline is the machine's
measured memory bandwidth: a decode step must read every K and V byte once.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch
import torch.nn.functional as F

import treeattn as ta


def median_seconds(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def read_bandwidth(nbytes: int = 1 << 30, repeats: int = 5) -> float:
    """Bytes read per second by a reduction over a 1 GiB tensor: the roofline of a decode step,
    which reads every K and V byte once and writes almost nothing."""
    src = torch.ones(nbytes // 4)
    return nbytes / median_seconds(lambda: src.sum(), repeats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[4096, 65536, 524288])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--threads", type=int, default=None, help="intra-op threads (default: torch's)")
    parser.add_argument("--heads", type=int, nargs=2, default=[32, 8], metavar=("HQ", "HKV"))
    parser.add_argument("--output", metavar="PATH", help="also write the rows (one object per sequence length) to this JSON file")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    if args.threads:
        torch.set_num_threads(args.threads)
    B, D = 1, 128
    Hq, Hkv = args.heads
    bandwidth = read_bandwidth()
    rows = []
    print(f"# {platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}, {args.dtype}, Hq={Hq}, "
          f"Hkv={Hkv}, D={D}")
    print(f"# measured read bandwidth (sum over 1 GiB): {bandwidth / 1e9:.1f} GB/s")
    print("| Sk | ta.attention | SDPA (same layout) | SDPA (B,H,S,D contiguous) | speedup vs best SDPA | ta K/V read rate | % "
          "of read bw |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for Sk in args.seq_lens:
        g = torch.Generator().manual_seed(0)
        q = torch.randn(B, 1, Hq, D, generator=g).to(dtype)
        k = torch.randn(B, Sk, Hkv, D, generator=g).to(dtype)
        v = torch.randn(B, Sk, Hkv, D, generator=g).to(dtype)
        k_heads, v_heads = k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()
        q_heads = q.transpose(1, 2)
        t_ours = median_seconds(lambda: ta.attention(q, k, v), args.repeats)
        t_sdpa = median_seconds(
            lambda: F.scaled_dot_product_attention(q_heads, k.transpose(1, 2), v.transpose(1, 2), enable_gqa=True), args.repeats
        )
        t_sdpa_contig = median_seconds(
            lambda: F.scaled_dot_product_attention(q_heads, k_heads, v_heads, enable_gqa=True), args.repeats
        )
        kv_bytes = 2 * k.numel() * k.element_size()
        row = {
            "seq_len": Sk,
            "ours_ms": t_ours * 1e3,
            "sdpa_ms": t_sdpa * 1e3,
            "sdpa_contiguous_ms": t_sdpa_contig * 1e3,
            "speedup_vs_best_sdpa": min(t_sdpa, t_sdpa_contig) / t_ours,
            "kv_read_gb_per_s": kv_bytes / t_ours / 1e9,
            "read_gb_per_s": bandwidth / 1e9,
        }
        rows.append(row)
        print(
            f"| {Sk:,} | {row['ours_ms']:.2f} ms | {row['sdpa_ms']:.2f} ms | {row['sdpa_contiguous_ms']:.2f} ms | "
            f"{row['speedup_vs_best_sdpa']:.2f}x | {row['kv_read_gb_per_s']:.1f} GB/s | "
            f"{100 * row['kv_read_gb_per_s'] / row['read_gb_per_s']:.0f}% |"
        )
        k = v = k_heads = v_heads = None
    if args.output:
        with open(args.output, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
