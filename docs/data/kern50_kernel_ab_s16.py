"""A/B of the paged decode kernel (session 16, kern50): this tree's treeattn.ops.paged_cpu_kernel against
another version of the file, one thread, one decode query over 4096 keys, blocks of 256, thread CPU time
(time.thread_time) of 30 layers, medians of ROUNDS rounds in which the two alternate (order flipped
every round); "cold": 30 distinct layers' arenas (streamed from memory), "hot": one layer's arena 30
times (in cache). maxdiff: the largest difference of the two kernels' outputs on one layer.

    git show 12fbd32:src/treeattn/ops/paged_cpu_kernel.py > /tmp/main_kernel.py
    PYTHONPATH=src python docs/data/kern50_kernel_ab_s16.py /tmp/main_kernel.py smollm2 float32,bfloat16,float16 7
"""
import sys, time, os, importlib.util
import numpy as np
sys.path.insert(0, "benchmarks/kernels")
import paged_kernel_roof as R
from treeattn.ops import paged_cpu_kernel as new
base = R.load_kernel(sys.argv[1])
heads = sys.argv[2].split(",") if len(sys.argv) > 2 else ["smollm2", "gemma3-270m"]
dtypes = sys.argv[3].split(",") if len(sys.argv) > 3 else ["float32", "float16"]
rounds = int(sys.argv[4]) if len(sys.argv) > 4 else 5
ctx = 4096
HEADS = {"smollm2": (3, 3, 64), "gemma3-270m": (1, 4, 256), "llama3.2-1b": (8, 4, 64)}
res = {}
for hd in heads:
    hkv, g, d = HEADS[hd]
    for dt in dtypes:
        nb = ctx // 256
        ar = R.arenas(dt, hkv, d, nb, 30, 0)
        rng = np.random.default_rng(1)
        q = rng.standard_normal((1, hkv, g, d)).astype(np.float32)
        table = np.arange(nb, dtype=np.int64)[None]; kv_pos = np.arange(nb * 256, dtype=np.int64)[None]
        row_seq = np.zeros(1, np.int64); q_pos = np.array([ctx], np.int64)
        out = np.empty((1, hkv, g, d), np.float32); lse = np.empty((1, hkv, g), np.float32)
        def run(mod, layers):
            t0 = time.thread_time()
            for (k, v, ks, vs) in layers:
                mod.attend(1, q, k, v, ks, vs, d, d ** -0.5, table, kv_pos, row_seq, q_pos, 0, 1, out, lse)
            return (time.thread_time() - t0) * 1e3
        outs = {}
        for name, mod in (("base", base), ("new", new)):
            run(mod, ar[:1]); outs[name] = out.copy()
        err = np.abs(outs["base"] - outs["new"]).max()
        for mode, layers in (("cold", ar), ("hot", [ar[0]] * 30)):
            t = {"base": [], "new": []}
            for i in range(rounds):
                for name, mod in ((("base", base), ("new", new)) if i % 2 == 0 else (("new", new), ("base", base))):
                    t[name].append(run(mod, layers))
            b, n = np.median(t["base"]), np.median(t["new"])
            print(f"{hd:12s} {dt:8s} {mode:4s} base {b:6.2f} ms  new {n:6.2f} ms  new/base {n/b:.3f}  maxdiff {err:.2e}  load {os.getloadavg()[0]:.1f}", flush=True)
