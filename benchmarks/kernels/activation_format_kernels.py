"""python benchmarks/kernels/activation_format_kernels.py  (issue 50) -- A/B in one process, alternated 41 times: each
SmolLM2/Gemma matrix through packed_matmul float32 vs int8, one thread.; min (and median ratio) of each."""
import time
import os
import numpy as np
import torch
import gguf
import gguf.quants
from treeattn.ops.packed_linear import unpack_blocks, packed_matmul
torch.set_num_threads(1)
Q = gguf.GGMLQuantizationType
shapes = [("smollm2 q_proj", 576, 576), ("smollm2 fused qkv", 960, 576), ("smollm2 fused gate+up", 3072, 576),
          ("smollm2 down_proj", 576, 1536),
          ("smollm2 output (q8_0)", 49152, 576), ("gemma3 fused gate+up", 4096, 640), ("gemma3 down", 640, 2048)]
rng = np.random.default_rng(0)
print("# load before", os.getloadavg())
for name, N, K in shapes:
    fmt, qt = ("q8_0", Q.Q8_0) if "q8_0" in name else ("q4_1", Q.Q4_1)
    qs, d, m = unpack_blocks(fmt, gguf.quants.quantize(rng.standard_normal((N, K)).astype(np.float32), qt))
    x = torch.randn(1, K)
    t = {"float32": [], "int8": []}
    reps = max(2, int(4e6 // (N * K)))
    for r in range(41):
        for a in ("float32", "int8"):
            packed_matmul(x, fmt, qs, d, m, activations=a)
            s = time.perf_counter()
            for _ in range(reps):
                packed_matmul(x, fmt, qs, d, m, activations=a)
            t[a].append((time.perf_counter() - s) / reps * 1e6)
    f, i = np.min(t["float32"]), np.min(t["int8"])
    fm, im = np.median(t["float32"]), np.median(t["int8"])
    print(f"| {name} | {fmt} {N}x{K} | {f:.1f} us | {i:.1f} us | {i / f:.2f} | {im / fm:.2f} |")
print("# load after", os.getloadavg())
