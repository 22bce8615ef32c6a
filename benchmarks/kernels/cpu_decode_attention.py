"""ops.attention's decode-sized CPU calls: the compiled kernel (ops.cpu_decode) against the matmul path
it replaced and torch's scaled_dot_product_attention (enable_gqa), in one process, same inputs.

    python3 benchmarks/kernels/cpu_decode_attention.py [--keys 4096 16384 65536] [--batch 1 8] [--threads 2]

One query per sequence, SmolLM2's heads (9 query heads, 3 KV heads of 64), float32, every key
visible (a decode step). Prints ms per call (median of --repeats) and the ratios.
"""

from __future__ import annotations

import torch

import treeattn as ta
from treeattn.bench import harness
from treeattn.bench.harness import median_seconds
from treeattn.ops import cpu_decode


def median_ms(fn, repeats: int) -> float:
    return median_seconds(fn, repeats) * 1e3


def main() -> None:
    parser = harness.parser(__doc__, threads=2, repeats=9, output=False)
    parser.add_argument("--keys", type=int, nargs="+", default=[4096, 16384, 65536])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    args = harness.parse_args(parser)
    torch.set_num_threads(args.threads)
    real = cpu_decode.decode_attention
    print(f"{'B':>3} {'keys':>7} {'kernel ms':>10} {'matmul ms':>10} {'sdpa ms':>9} {'kernel/matmul':>14} {'kernel/sdpa':>12}")
    for batch in args.batch:
        for keys in args.keys:
            g = torch.Generator().manual_seed(0)
            q = torch.randn(batch, 1, 9, 64, generator=g)
            k = torch.randn(batch, keys, 3, 64, generator=g)
            v = torch.randn(batch, keys, 3, 64, generator=g)
            kernel = median_ms(lambda: ta.attention(q, k, v), args.repeats)
            cpu_decode.decode_attention = lambda *a, **kw: None  # the matmul path
            try:
                matmul = median_ms(lambda: ta.attention(q, k, v), args.repeats)
            finally:
                cpu_decode.decode_attention = real
            qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
            sdpa = median_ms(lambda: torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True), args.repeats)
            print(f"{batch:>3} {keys:>7} {kernel:>10.2f} {matmul:>10.2f} {sdpa:>9.2f} {kernel / matmul:>14.2f} "
                  f"{kernel / sdpa:>12.2f}")


if __name__ == "__main__":
    main()
