import time, numpy as np, torch
from treeattn.ops.paged_decode import PagedDecodeLayout, paged_decode_attention
torch.set_num_threads(1)
S, BS, Hkv, D, Hq = 30720, 256, 1, 256, 4
nb = S // BS
def arena_torch(): return torch.empty(nb + 1, BS, Hkv, D, dtype=torch.float16)
def arena_numpy():
    a = np.empty((nb + 1) * BS * Hkv * D * 2, np.uint8)
    return torch.from_numpy(a).view(torch.float16).view(nb + 1, BS, Hkv, D)
g = torch.Generator().manual_seed(0)
src = torch.randn(nb + 1, BS, Hkv, D, generator=g).half()
kt, vt, kn, vn = arena_torch(), arena_torch(), arena_numpy(), arena_numpy()
for t in (kt, kn): t.copy_(src)
for t in (vt, vn): t.copy_(src.flip(0))
table = torch.arange(nb).view(1, nb); kv_pos = torch.arange(S).view(1, S); q_pos = torch.tensor([[S]])
layout = PagedDecodeLayout(table, kv_pos, q_pos, block_size=BS)
q = torch.randn(1, 1, Hq, D, generator=g)
a = paged_decode_attention(q, kt, vt, layout); b = paged_decode_attention(q, kn, vn, layout)
print("identical", torch.equal(a[0], b[0]))
print([l.strip() for l in open("/proc/self/smaps_rollup") if "AnonHuge" in l])
res = {"torch": [], "numpy": []}
for r in range(8):
    for name, (k, v) in (("torch", (kt, vt)), ("numpy", (kn, vn))):
        c = time.thread_time()
        for _ in range(5): paged_decode_attention(q, k, v, layout)
        res[name].append((time.thread_time() - c) / 5 * 1e3)
for n, v in res.items(): print(n, "30K keys one layer, thread cpu median %.3f ms" % np.median(v), " ".join("%.2f" % x for x in v))
