"""The packed-weight kernel alone against torch's float32 GEMV over the same weights dequantized.

    python benchmarks/kernels/packed_kernel.py --threads 1 --rounds 30

One decode row x (1, K) float32 times a weight W (N, K) of SmolLM2-135M's shapes (a layer's q / gate /
down projections and the 49152-row output projection), for each of ggml's q4_0, q4_1 and q8_0 formats
(random blocks quantized by gguf.quants): treeattn.ops.packed_linear.packed_matmul over the packed
blocks (the `--weight-format packed` path) and F.linear over the float32 dequantized weight (the
`dequantize` path), taking turns `--rounds` times; the minimum of each is reported, in weights per
second, with the ratio of times. Each turn runs over enough distinct copies of the matrix that their
float32 weights exceed `--stream-mb` (default 256 MB, as a model's 30 layers do), so both read their
weights from memory, not from a cache that a single small matrix would fit in. Both results are checked against float64 x @ W.T.
torch runs with
`--threads` threads (the kernel splits only the output projection over them: PARALLEL_MIN_WEIGHTS).
"""

from __future__ import annotations

import json
import os
import platform
import time

import numpy as np
import torch
import torch.nn.functional as F

from treeattn.bench import harness

SHAPES = {"q_proj 576x576": (576, 576), "gate_proj 1536x576": (1536, 576), "down_proj 576x1536": (576, 1536),
          "output 49152x576": (49152, 576)}


def main() -> None:
    parser = harness.parser(__doc__, threads=1, output=False)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--formats", nargs="+", default=["q4_0", "q4_1", "q8_0"])
    parser.add_argument("--stream-mb", type=int, default=256)
    args = harness.parse_args(parser)
    import gguf

    from treeattn.ops.packed_linear import dequantize_packed, packed_matmul, unpack_blocks

    torch.set_num_threads(args.threads)
    load = os.getloadavg()
    rng = np.random.default_rng(0)
    rows = []
    for fmt in args.formats:
        qtype = gguf.GGMLQuantizationType[fmt.upper()]
        for name, (N, K) in SHAPES.items():
            raw = gguf.quants.quantize(rng.standard_normal((N, K), dtype=np.float32) * 0.05, qtype)
            qs, d, m = unpack_blocks(fmt, raw.reshape(N, -1))
            w = dequantize_packed(fmt, qs, d, m)
            x = torch.from_numpy(rng.standard_normal((1, K), dtype=np.float32))
            expected = x.double() @ w.double().T
            copies = max(1, -(-args.stream_mb * 2**20 // (N * K * 4)))
            packed = [(qs.clone(), d.clone(), None if m is None else m.clone()) for _ in range(copies)]
            dense = [w.clone() for _ in range(copies)]
            with torch.inference_mode():
                fns = {"packed": lambda: [packed_matmul(x, fmt, *p) for p in packed][-1],
                       "float32": lambda: [F.linear(x, w_) for w_ in dense][-1]}
                best = {}
                for key, fn in fns.items():
                    err = float((fn().double() - expected).abs().max() / expected.abs().max())
                    assert err < 1e-5, f"{fmt} {name} {key}: relative error {err:.1e}"
                for _ in range(args.rounds):
                    for key, fn in fns.items():
                        start = time.perf_counter()
                        fn()
                        best[key] = min(best.get(key, float("inf")), time.perf_counter() - start)
            packed = dense = None
            rows.append({"format": fmt, "matrix": name, "copies": copies, "packed_gw_s": copies * N * K / best["packed"] / 1e9,
                         "float32_gw_s": copies * N * K / best["float32"] / 1e9,
                         "packed_over_float32_time": best["packed"] / best["float32"]})
    print(json.dumps({"rows": rows, "threads": args.threads, "load_average": [load, os.getloadavg()],
                      "machine": f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}"}, indent=1))
    print("| format | matrix | packed G weights/s | float32 G weights/s | packed / float32 time |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['format']} | {r['matrix']} | {r['packed_gw_s']:.2f} | {r['float32_gw_s']:.2f} | "
              f"{r['packed_over_float32_time']:.2f} |")


if __name__ == "__main__":
    main()
