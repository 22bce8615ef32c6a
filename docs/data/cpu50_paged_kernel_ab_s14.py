import time, sys, numpy as np, torch
from treeattn.ops import paged_cpu_kernel as K
torch.manual_seed(0)
H,G,D,BS,nb,L = 3,3,64,256,16,30
threads = int(sys.argv[1]) if len(sys.argv) > 1 else 1
q = torch.randn(1,H,G,D).numpy()
arenas = {}
for name, dt in (("f32", torch.float32), ("bf16", torch.bfloat16), ("f16", torch.float16)):
    kk = [torch.randn(nb, BS, H, D).to(dt) for _ in range(L)]
    vv = [torch.randn(nb, BS, H, D).to(dt) for _ in range(L)]
    bits = {torch.float32: torch.float32, torch.bfloat16: torch.uint16, torch.float16: torch.int16}[dt]
    arenas[name] = [(k.view(bits).numpy(), v.view(bits).numpy()) for k, v in zip(kk, vv)]
table = np.arange(nb, dtype=np.int64).reshape(1, nb); kv_pos = np.arange(nb*BS, dtype=np.int64).reshape(1,-1)
row_seq = np.zeros(1, np.int64); q_pos = np.array([nb*BS], np.int64)
splits = 1 if threads == 1 else 4
out = np.empty((1,H,G,D), np.float32); lse = np.empty((1,H,G), np.float32)
def run(name):
    for k, v in arenas[name]:
        K.attend(threads, q, k, v, K.NO_SCALES, K.NO_SCALES, D, 0.125, table, kv_pos, row_seq, q_pos, 0, splits, out, lse)
for name in arenas: run(name)
res = {n: [] for n in arenas}
for rep in range(7):
    for name in arenas:
        t = time.thread_time(); run(name); res[name].append(time.thread_time() - t)
for name, ts in res.items():
    b = L*nb*BS*H*D*2*(4 if name == "f32" else 2)
    print(f"{name} threads={threads} min {min(ts)*1e3:.2f} ms median {sorted(ts)[3]*1e3:.2f} ms  {b/min(ts)/1e9:.1f} GB/s")
