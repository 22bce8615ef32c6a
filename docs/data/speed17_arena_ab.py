import time, sys, numpy as np, torch
from treeattn.models.loader import load_model
from treeattn.models.packed import fuse_projections, pack_arena, set_activation_format
torch.set_num_threads(1)
def huge(): return [l.strip() for l in open("/proc/self/smaps_rollup") if "AnonHuge" in l]
a = load_model(sys.argv[1], weight_format="packed", with_tokenizer=False)
b = load_model(sys.argv[1], weight_format="packed", with_tokenizer=False)
for m in (a, b): fuse_projections(m); set_activation_format(m, "int8")
print("before", huge()); print("moved", pack_arena(b) / 1e6, "MB", huge())
h = torch.randn(1, 1, 640)
def one(m):
    with torch.inference_mode():
        c = time.thread_time(); l = m.logits(h); t1 = time.thread_time() - c
        c = time.thread_time()
        x = h
        for layer in m.layers:
            y = layer.mlp(x); q = layer.self_attn.fused(x); o = layer.self_attn.o_proj(torch.randn(1, 1, 1024))
        t2 = time.thread_time() - c
    return l, t1 * 1e3, t2 * 1e3
la, _, _ = one(a); lb, _, _ = one(b)
print("identical logits", torch.equal(la, lb))
res = {"torch": [], "arena": []}
for r in range(6):
    for name, m in (("torch", a), ("arena", b)):
        res[name].append(one(m)[1:])
for name, v in res.items():
    v = np.array(v); print(name, "head median %.2f ms, layer matmuls median %.2f ms (thread cpu, 1 thread)" % tuple(np.median(v, 0)))
