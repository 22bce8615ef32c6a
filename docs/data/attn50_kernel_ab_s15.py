# Scratch A/B of kernel variants (session 15, attn50): run from a checkout of c13e013 (main before session 15, whose
# attend_serial is "main" here; "kept" is the kernel as kept: head dim 64 constant, float32 scale), e.g.
# PYTHONPATH=<c13e013>/src:docs/data python3 docs/data/attn50_kernel_ab_s15.py smollm2 4096 f32,bf16 main,c64 5
# args: heads (smollm2|llama|gemma3) context dtypes(f32,bf16,f16,fp8) variants repeats; output: docs/data/attn50_kernel_ab_s15.txt
import sys, time, statistics, os
import numpy as np, torch
sys.path.insert(0, 'docs/data')
import attn50_kernel_variants_s15 as variants
from treeattn.ops import paged_cpu_kernel as K
from treeattn.ops.fp8 import quantize_fp8
HEADS = {"smollm2": (3, 3, 64), "gemma3": (1, 4, 256), "llama": (8, 4, 64)}
heads = sys.argv[1]; ctx = int(sys.argv[2]); dtypes = sys.argv[3].split(","); names = sys.argv[4].split(",")
reps = int(sys.argv[5]) if len(sys.argv) > 5 else 5
H, G, D = HEADS[heads]; BS = 256; nb = ctx // BS
L = max(2, min(30, (1 << 29) // (2 * ctx * H * D * 4)))
V = {"kept": variants.make(False, 0, 64, 64, f32s=1), "keptlh": variants.make(False, 0, 64, 64, f32s=1, lh=1),"sc32": variants.make(False, 0, f32s=1),"ch16": variants.make_chunked(16), "ch32": variants.make_chunked(32), "ch8": variants.make_chunked(8),"s2": variants.make(False, 2), "s2v4": variants.make(True, 2, N=4, pf=16),"d16": variants.make(False, 0, d16=1), "d16v": variants.make(False, 0, d16=2),"v2p8": variants.make(True, 0, N=2, pf=8), "v4p16": variants.make(True, 0, N=4, pf=16), "v4p32": variants.make(True, 0, N=4, pf=32),"v2": variants.make(True, 0, N=2), "v4": variants.make(True, 0, N=4), "v8": variants.make(True, 0, N=8), "v16": variants.make(True, 0, N=16),"pf": variants.make(False, 0, pf=1), "pfc": variants.make(False, 0, 64, 64, pf=1),"c64": variants.make(False, 0, 64, 64), "nos": variants.make(False, 0, skip="s"), "noe": variants.make(False, 0, skip="e"), "nov": variants.make(False, 0, skip="v"), "only_s": variants.make(False, 0, skip="ev"),"main": K.attend_serial, "vchunk": variants.make(True, 0), "part": variants.make(False, 1), "both": variants.make(True, 1)}
q = np.random.default_rng(0).standard_normal((1, H, G, D)).astype(np.float32)
table = np.arange(nb, dtype=np.int64).reshape(1, nb); kv_pos = np.arange(nb * BS, dtype=np.int64).reshape(1, -1)
row_seq = np.zeros(1, np.int64); q_pos = np.array([nb * BS - 3], np.int64)  # 2 keys not visible
def arenas(dt):
    out = []
    for _ in range(L):
        kv = [torch.randn(nb, BS, H, D) for _ in range(2)]
        if dt == "fp8":
            (kc, ks), (vc, vs) = (quantize_fp8(x) for x in kv)
            out.append((kc.view(torch.uint8).numpy(), vc.view(torch.uint8).numpy(), ks.numpy(), vs.numpy()))
        else:
            bits = {"f32": torch.float32, "bf16": torch.uint16, "f16": torch.int16}[dt]
            tdt = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}[dt]
            out.append(tuple(x.to(tdt).view(bits).numpy() for x in kv) + (K.NO_SCALES, K.NO_SCALES))
    return out
A = {dt: arenas(dt) for dt in dtypes}
res = {}
outs = {}
def run(name, dt, hot):
    fn = V[name]
    o = np.empty((1, H, G, D), np.float32); lse = np.empty((1, H, G), np.float32)
    todo = A[dt][:1] * L if hot else A[dt]
    for k, v, ks, vs in todo:
        fn(q, k, v, ks, vs, D, D ** -0.5, table, kv_pos, row_seq, q_pos, 0, 1, o, lse)
    outs[(name, dt)] = o.copy()
for dt in dtypes:
    for n in names:
        run(n, dt, False)
    for n in names[1:]:
        print(dt, n, "max abs diff vs", names[0], float(np.abs(outs[(n, dt)] - outs[(names[0], dt)]).max()))
for rep in range(reps):
    for dt in dtypes:
        for hot in (False, True):
            for n in names:
                t = time.thread_time(); run(n, dt, hot); res.setdefault((dt, hot, n), []).append(time.thread_time() - t)
print(f"{heads} ctx {ctx} layers {L} (ms per 30 layers, median thread cpu of {reps}); load {os.getloadavg()}")
for (dt, hot, n), ts in res.items():
    base = statistics.median(res[(dt, hot, names[0])])
    print(f"{dt:5s} {'hot ' if hot else 'cold'} {n:8s} {statistics.median(ts)*1e3*30/L:7.2f} ms  ratio {statistics.median(ts)/base:.3f}")
