"""PYTHONPATH=src python benchmarks/kernels/float32_kernel_ab.py --baseline-src DIR [--rounds 9] [--shapes NAME ...]

Issue 50, session 21. The exact float32 packed kernel (treeattn.ops.packed_cpu_kernel) of this tree against the
one under DIR (a `git archive` of another commit's src/), alternated A B A B in one process, one thread, thread CPU
time (time.thread_time_ns: what the call's thread ran, stalls on memory included, time the OS gave to other processes
excluded). Each round times
every shape "hot" (right after a call on the same weight) and "cold" (after writing a 512 MB buffer: the weight comes
from memory, as an output projection does in a decode step, after 30 layers and their K/V); the int8 kernel
(packed_int8_kernel, llama.cpp's arithmetic) is timed beside them for scale where the host has it. The weights are
random blocks held in one arena (models.packed.arena_copies: huge pages, as the engine holds them). Prints, per shape and
state, the median of the rounds in us, G multiply-adds/s, B/A, and whether A and B gave the same bits.
"""
import argparse
import importlib.util
import os
import shutil
import sys
import tempfile
import time

import numpy as np
import torch

SHAPES = {  # name: (format, rows N, columns K)
    "smollm2 head": ("q8_0", 49152, 576), "gemma3 head": ("q8_0", 262144, 640), "q8_0 576x576": ("q8_0", 576, 576),
    "smollm2 gate+up": ("q4_1", 3072, 576), "smollm2 down": ("q4_1", 576, 1536), "q4_1 576x576": ("q4_1", 576, 576),
}


def load_kernel(src: str, name: str):
    """packed_cpu_kernel.py of the tree at `src`, copied into a new temporary folder and imported from there as `name`:
    numba caches machine code beside a kernel's file under the name of the module that compiled it, and a cache entry
    written under another name breaks that tree's own import of the module."""
    folder = tempfile.mkdtemp(prefix="float32_kernel_ab_")
    path = shutil.copy(os.path.join(src, "treeattn", "ops", "packed_cpu_kernel.py"), os.path.join(folder, f"{name}.py"))
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def weight(fmt: str, N: int, K: int, rng):
    """Random blocks of `fmt` in one arena: qs, d, m (m = d for q8_0) as numpy arrays."""
    from treeattn.models.packed import arena_copies

    nb = K // 32
    if fmt == "q8_0":
        qs = torch.from_numpy(rng.integers(-127, 128, (N, nb, 32), dtype=np.int8))
    else:
        qs = torch.from_numpy(rng.integers(0, 256, (N, nb, 16), dtype=np.uint8))
    d = torch.from_numpy(rng.random((N, nb), dtype=np.float32).astype(np.float16).astype(np.float32) * 0.01)
    m = torch.from_numpy(-rng.random((N, nb), dtype=np.float32).astype(np.float16).astype(np.float32) * 0.1)
    qs, d, m = arena_copies([qs, d, m])
    return qs.numpy(), d.numpy(), (d if fmt == "q8_0" else m).numpy()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline-src", required=True, help="src/ of the baseline tree (A)")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--no-int8", action="store_true", help="leave the int8 kernel out")
    args = parser.parse_args()
    torch.set_num_threads(1)
    # B is imported by its own name (PYTHONPATH=<this tree>/src), A from a copy (load_kernel)
    from treeattn.ops import packed_cpu_kernel
    from treeattn.ops.packed_linear import int8_module

    kernels = {"A": load_kernel(args.baseline_src, "baseline_packed_cpu_kernel"), "B": packed_cpu_kernel}

    int8 = None if args.no_int8 else int8_module()
    if int8 is not None:
        kernels["int8"] = int8
    junk = np.zeros(128 << 20, np.float32)  # 512 MB
    rng = np.random.default_rng(0)
    print(f"# load before {os.getloadavg()}; A = {args.baseline_src}, B = this tree; thread CPU time, one thread")
    print("| shape | format N x K | state | " + " | ".join(f"{k} us (G MAC/s)" for k in kernels) + " | B/A | same bits |")
    print("|---|---|---|" + "---|" * (len(kernels) + 2))
    for name in args.shapes:
        fmt, N, K = SHAPES[name]
        qs, d, m = weight(fmt, N, K, rng)
        x = rng.standard_normal((1, K)).astype(np.float32)
        outs = {k: np.empty((1, N), np.float32) for k in kernels}
        times = {(k, s): [] for k in kernels for s in ("hot", "cold")}
        for _ in range(args.rounds):
            for k, module in kernels.items():
                for state in ("cold", "hot"):
                    if state == "cold":
                        junk += 1.0
                    else:
                        module.matmul(1, fmt, x, qs, d, m, outs[k])
                    start = time.thread_time_ns()
                    module.matmul(1, fmt, x, qs, d, m, outs[k])
                    times[k, state].append((time.thread_time_ns() - start) / 1e3)
        same = bool(np.array_equal(outs["A"].view(np.int32), outs["B"].view(np.int32)))
        for state in ("hot", "cold"):
            med = {k: float(np.median(times[k, state])) for k in kernels}
            cells = " | ".join(f"{med[k]:.1f} ({N * K / med[k] / 1e3:.2f})" for k in kernels)
            print(f"| {name} | {fmt} {N}x{K} | {state} | {cells} | {med['B'] / med['A']:.3f} | {same} |", flush=True)
    print(f"# load after {os.getloadavg()}")


if __name__ == "__main__":
    main()
