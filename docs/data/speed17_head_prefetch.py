import time, torch, sys, numpy as np, importlib
sys.path.insert(0, "/tmp/speed17/kv")
from treeattn.models.loader import load_model
m = load_model(sys.argv[1], weight_format="packed", with_tokenizer=False)
e = m.embed_tokens; v = e._cached(); qs, d, mm = v.arrays
x = np.random.randn(1, 640).astype(np.float32)
names = ["k_old", "k_4096", "k_d2", "k_d1024", "k_d2_1024"]
mods = {n: importlib.import_module(n) for n in names}
outs = {}
for n in names:
    out = np.empty((1, qs.shape[0]), np.float32); mods[n].matmul(1, "q8_0", x, qs, d, mm, out); outs[n] = out
print("identical:", all(np.array_equal(outs["k_old"], o) for o in outs.values()))
res = {n: [] for n in names}
for r in range(6):
    for n in names:
        out = outs[n]; c = time.thread_time()
        for _ in range(3): mods[n].matmul(1, "q8_0", x, qs, d, mm, out)
        res[n].append((time.thread_time() - c) / 3 * 1e3)
for n in names: print(n, "thread cpu ms per head, 1 thread: median %.2f  all %s" % (np.median(res[n]), " ".join("%.1f" % v for v in res[n])))
