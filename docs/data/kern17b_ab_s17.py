"""A/B of paged_cpu_kernel.py files on one attention shape (float16 blocks), 8 layers cold and one layer 8x hot,
thread CPU time, the files alternating in rounds; ratios of medians to the first file (session 17, kern17b).
usage (from the repository root, PYTHONPATH=src): python docs/data/kern17b_ab_s17.py HEADS CONTEXT ROUNDS base.py v1.py ...
The first file is imported as paged_cpu_kernel_baseline, the name benchmarks/kernels/paged_kernel_roof.py --baseline
gives it (so that their numba caches agree); the others as k17b_<file name>."""
import importlib.util, os, statistics, sys, time
import numpy as np
sys.path.insert(0, os.path.join(os.getcwd(), "benchmarks/kernels"))
import paged_kernel_roof as roof

def load(path, name):
    spec = importlib.util.spec_from_file_location(name, path)
    m = importlib.util.module_from_spec(spec); sys.modules[name] = m; spec.loader.exec_module(m); return m

heads, context, rounds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
mods = {os.path.basename(p): load(p, "paged_cpu_kernel_baseline" if i == 0 else "k17b_" + os.path.basename(p)[:-3]) for i, p in enumerate(sys.argv[4:])}
hkv, grp, d = roof.HEADS[heads]; nb = context // 256; layers = 8
q = np.random.default_rng(0).standard_normal((1, hkv, grp, d)).astype(np.float32)
table = np.arange(nb, dtype=np.int64).reshape(1, nb); kv_pos = np.arange(nb * 256, dtype=np.int64).reshape(1, -1)
row_seq, q_pos = np.zeros(1, np.int64), np.array([nb * 256], np.int64)
ar = roof.arenas("float16", hkv, d, nb, layers, seed=2)
outs = {}
def run(m, todo):
    out, lse = np.empty((1, hkv, grp, d), np.float32), np.empty((1, hkv, grp), np.float32)
    for k, v, ks, vs in todo:
        m.attend(1, q, k, v, ks, vs, d, d ** -0.5, table, kv_pos, row_seq, q_pos, 0, 1, out, lse)
    return out
for n, m in mods.items():
    outs[n] = run(m, ar[-1:])
base = list(outs)[0]
for n in outs: print(n, "max diff vs base", float(np.abs(outs[n] - outs[base]).max()))
t = {(n, c): [] for n in mods for c in ("cold", "hot")}
for _ in range(rounds):
    for n, m in mods.items():
        for c, todo in (("cold", ar), ("hot", ar[:1] * layers)):
            s = time.thread_time(); run(m, todo); t[n, c].append(time.thread_time() - s)
print(f"{heads} {context} keys, {rounds} rounds, load {os.getloadavg()}")
for c in ("cold", "hot"):
    b = statistics.median(t[base, c])
    print(c, " ".join(f"{n} {statistics.median(t[n, c]) / b:.3f}" for n in mods), f"(base {1e3 * b / layers:.2f} ms/layer)")
