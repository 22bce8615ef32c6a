# Under load: time per key x KV head of the paged kernel, "cold" (16 distinct layers: 16K keys x 4 KV heads, or 8K x 8) against "L2" (one 256-key block repeated 2048 times); float16, 1 thread, medians of 5 alternated rounds; "base" = a second copy of the kernel file (/tmp/k19_base_kernel.py: git show f34aec7:src/treeattn/ops/paged_cpu_kernel.py).
import time, numpy as np, torch, statistics, sys, importlib.util
from treeattn.ops import paged_cpu_kernel as K
def load(path):
    spec = importlib.util.spec_from_file_location("paged_cpu_kernel_baseline", path); m = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = m; spec.loader.exec_module(m); return m
B = load('/tmp/k19_base_kernel.py')
BS=256; G=4; D=64
def mk(hkv, nb, dtype):
    g=torch.Generator().manual_seed(0)
    k,v=[torch.randn(nb,BS,hkv,D,generator=g).to(dtype).view(torch.int16).numpy() for _ in range(2)]
    return k,v
def runner(mod, hkv, keys, arenas_k_v, layers):
    nb=keys//BS
    q=np.random.default_rng(0).standard_normal((1,hkv,G,D)).astype(np.float32)
    table=np.arange(nb,dtype=np.int64).reshape(1,nb); kv_pos=np.arange(nb*BS,dtype=np.int64).reshape(1,-1)
    rs=np.zeros(1,np.int64); qp=np.array([nb*BS],np.int64)
    out=np.empty((1,hkv,G,D),np.float32); lse=np.empty((1,hkv,G),np.float32)
    def run():
        for i in range(layers):
            k,v=arenas_k_v[i%len(arenas_k_v)]
            mod.attend(1,q,k,v,K.NO_SCALES,K.NO_SCALES,D,0.125,table,kv_pos,rs,qp,0,1,out,lse)
    return run
res={}
cases={}
for hkv in (4,8):
    cold=[mk(hkv,64 if hkv==4 else 32,torch.float16) for _ in range(16)]
    hot=[mk(hkv,1,torch.float16)]
    keys=16384 if hkv==4 else 8192
    for name,mod in (("new",K),("base",B)):
        cases[(hkv,'cold',name)]=(runner(mod,hkv,keys,cold,16),16*keys*hkv)
        cases[(hkv,'L2 1 block',name)]=(runner(mod,hkv,256,hot,2048),2048*256*hkv)
for f,_ in cases.values(): f()
t={c:[] for c in cases}
for r in range(5):
    for c,(f,n) in cases.items():
        a=time.thread_time(); f(); t[c].append(time.thread_time()-a)
for c,(f,n) in cases.items():
    m=statistics.median(t[c]); print(c, f"{1e9*m/n:.3f} ns per key x KV head")
import os; print(os.getloadavg())
