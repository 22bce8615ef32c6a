import torch, time, resource, statistics, torch.nn.functional as F
torch.set_num_threads(1)
g=torch.Generator().manual_seed(0)
W=torch.randn(49152,576,generator=g)*0.05
x=torch.randn(512,576,generator=g)
res={}
for rep in range(5):
    for cols in (512,1024,2048,4096):
        for mode in ("fresh","out"):
            buf=torch.empty(512,cols)
            f0=resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            s=time.thread_time_ns()
            for first in range(0,49152,cols):
                if mode=="fresh": y=F.linear(x,W[first:first+cols])
                else: torch.mm(x,W[first:first+cols].T,out=buf)
            t=(time.thread_time_ns()-s)*1e-9
            res.setdefault((cols,mode),[]).append((t, resource.getrusage(resource.RUSAGE_SELF).ru_minflt-f0))
for k,v in res.items():
    ts=[a for a,_ in v]; print(k, "median s %.4f"%statistics.median(ts), "GFLOP/s %.1f"%(512*576*49152*2/statistics.median(ts)/1e9), "faults", [b for _,b in v])
y1=F.linear(x,W[:2048]); y2=torch.empty(512,2048); torch.mm(x,W[:2048].T,out=y2); print("equal", torch.equal(y1,y2))
