"""The packed-weight kernel of an earlier commit against this checkout's, alternated in one process.

    python benchmarks/kernels/packed_kernel_ab.py --baseline f43069f

The baseline's src/treeattn/ops/packed_cpu_kernel.py (git show REV:...) is imported from a temporary
folder beside this checkout's module, and both multiply the same random blocks (quantized by
gguf.quants) by one decode row on one thread, taking turns --rounds times over enough copies of each
matrix to stream --stream-mb from memory; the median of each is reported in weights per second, with
the ratio of times, each one's largest difference from float64 x @ W.T, and whether the two outputs
are the same bits. Shapes: SmolLM2-135M's and
Gemma 3 270M's layer matrices and output projections (half of Gemma's: one of two ranks' share).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

SHAPES = [("smollm2 q_proj", 576, 576), ("smollm2 gate_proj", 1536, 576), ("smollm2 down_proj", 576, 1536),
          ("smollm2 output", 49152, 576), ("gemma3 q_proj", 1024, 640), ("gemma3 gate_proj", 2048, 640),
          ("gemma3 down_proj", 640, 2048), ("gemma3 output / 2", 131072, 640)]
MODULE = "src/treeattn/ops/packed_cpu_kernel.py"


def baseline_module(rev: str, folder: str):
    """The kernel module as it was at git revision `rev`, imported under another name."""
    root = Path(__file__).resolve().parents[2]
    source = subprocess.run(["git", "-C", str(root), "show", f"{rev}:{MODULE}"], check=True, capture_output=True,
                            text=True).stdout
    path = Path(folder) / "packed_cpu_kernel_baseline.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("packed_cpu_kernel_baseline", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", required=True, help="git revision of the kernel to compare against")
    parser.add_argument("--formats", nargs="+", default=["q4_0", "q4_1", "q8_0"])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--stream-mb", type=int, default=256)
    args = parser.parse_args()
    import gguf

    from treeattn.ops import packed_cpu_kernel as current
    from treeattn.ops.packed_linear import dequantize_packed, unpack_blocks

    rng = np.random.default_rng(0)
    print(f"# load before {os.getloadavg()}, baseline {args.baseline}, one thread")
    print("| format | matrix | baseline G weights/s | this checkout G weights/s | time ratio | max error vs float64: baseline / "
          "this | same bits |")
    print("|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as folder:
        baseline = baseline_module(args.baseline, folder)
        for fmt in args.formats:
            for name, N, K in SHAPES:
                raw = gguf.quants.quantize(rng.standard_normal((N, K), dtype=np.float32) * 0.05,
                                           gguf.GGMLQuantizationType[fmt.upper()])
                qs, d, m = unpack_blocks(fmt, raw.reshape(N, -1))
                x = rng.standard_normal((1, K), dtype=np.float32)
                expected = x.astype(np.float64) @ dequantize_packed(fmt, qs, d, m).double().numpy().T
                arrays = (qs.numpy(), d.numpy(), (d if m is None else m).numpy())
                copies = max(1, -(-args.stream_mb * 2**20 // (N * K * 4)))
                sets = [tuple(a.copy() for a in arrays) for _ in range(copies)]
                times, errors, outs = {"baseline": [], "this": []}, {}, {}
                for _ in range(args.rounds):
                    for label, module in (("baseline", baseline), ("this", current)):
                        out = np.empty((1, N), np.float32)
                        start = time.perf_counter()
                        for a in sets:
                            module.matmul(1, fmt, x, *a, out)
                        times[label].append((time.perf_counter() - start) / copies)
                        errors[label], outs[label] = float(np.abs(out - expected).max()), out
                old, new = (float(np.median(times[k][1:])) for k in ("baseline", "this"))  # the first round compiles or loads
                print(f"| {fmt} | {name} {N}x{K} | {N * K / old / 1e9:.1f} | {N * K / new / 1e9:.1f} | {new / old:.2f} | "
                      f"{errors['baseline']:.1e} / {errors['this']:.1e} | "
                      f"{'yes' if np.array_equal(outs['baseline'], outs['this']) else 'no'} |",
                      flush=True)
    print(f"# load after {os.getloadavg()}; {sys.platform}, torch {torch.__version__}")


if __name__ == "__main__":
    main()
