"""A/B of paged_cpu_kernel.py files (session 17, kern17): min and median thread CPU time over alternated rounds, 8 layers cold (distinct arenas) and one layer 8 times hot.

    PYTHONPATH=src python3 docs/data/kern17_ab_s17.py MODEL CONTEXT ROUNDS DTYPE FILE.py FILE.py ...   (DTYPE: float16, bfloat16, float32, fp8)
"""
import sys, time, importlib.util, statistics
import numpy as np, torch
heads = {"smollm2": (3, 3, 64), "gemma3-270m": (1, 4, 256), "llama3.2-1b": (8, 4, 64)}
model, ctx, rounds, dtype = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
files = sys.argv[5:]
mods = []
for i, f in enumerate(files):
    spec = importlib.util.spec_from_file_location("kab_" + f.split('/')[-1][:-3], f)
    m = importlib.util.module_from_spec(spec); sys.modules[spec.name] = m; spec.loader.exec_module(m); mods.append(m)
hkv, g, d = heads[model]; BS = 256; nb = ctx // BS
bits = {"float16": torch.int16, "bfloat16": torch.uint16, "float32": torch.float32, "fp8": None}[dtype]
layers = 8
gen = torch.Generator().manual_seed(0)
if dtype == "fp8":
    from treeattn.ops.fp8 import quantize_fp8
    ar = []
    for _ in range(layers):
        (kc, ks), (vc, vs) = (quantize_fp8(torch.randn(nb, BS, hkv, d, generator=gen)) for _ in range(2))
        ar.append((kc.view(torch.uint8).numpy(), vc.view(torch.uint8).numpy(), ks.numpy(), vs.numpy()))
else:
    ar = [[torch.randn(nb, BS, hkv, d, generator=gen).to(getattr(torch, dtype)).view(bits).numpy() for _ in range(2)] + [None, None] for _ in range(layers)]
q = np.random.default_rng(0).standard_normal((1, hkv, g, d)).astype(np.float32)
table = np.arange(nb, dtype=np.int64).reshape(1, nb); kv_pos = np.arange(nb * BS, dtype=np.int64).reshape(1, -1)
rs, qp = np.zeros(1, np.int64), np.array([nb * BS], np.int64)
out, lse = np.empty((1, hkv, g, d), np.float32), np.empty((1, hkv, g), np.float32)
def run(m, todo):
    for k, v, ks, vs in todo:
        m.attend(1, q, k, v, m.NO_SCALES if ks is None else ks, m.NO_SCALES if vs is None else vs, d, d ** -0.5, table, kv_pos, rs, qp, 0, 1, out, lse)
res = {}
outs = []
for m in mods:
    run(m, ar[:1]); outs.append(out.copy())
for o in outs[1:]:
    assert np.allclose(o, outs[0], rtol=1e-4, atol=1e-5)
for r in range(rounds):
    for i, m in enumerate(mods):
        for kind, todo in (("hot", ar[:1] * layers), ("cold", ar)):
            c = time.thread_time(); run(m, todo); res.setdefault((i, kind), []).append(time.thread_time() - c)
import os
print(f"{model} {ctx} {dtype} load {os.getloadavg()[0]:.1f}; ms per layer (min / median); ratio of medians to the first file")
for kind in ("cold", "hot"):
    base = statistics.median(res[(0, kind)])
    for i, f in enumerate(files):
        x = res[(i, kind)]
        print(f"{kind:4s} {f:32s} {1e3*min(x)/layers:7.3f} / {1e3*statistics.median(x)/layers:7.3f}  {statistics.median(x)/base:.3f}")
