import sys, time, torch, treeattn as ta
from treeattn.eval.demo import smollm2_path
path = sys.argv[1] if len(sys.argv) > 1 else smollm2_path()
n = int(sys.argv[2]) if len(sys.argv) > 2 else 200
extra = dict(a.split("=") for a in sys.argv[3:])
with ta.Engine(path, nproc=1, weight_format="packed", **extra) as e:
    e.generate([[1] * 64], max_new_tokens=8, temperature=0.0, ignore_eos=True)
    r = e.generate([[1] * 64], max_new_tokens=n, temperature=0.0, ignore_eos=True)[0]
    print("ms/token", r.decode_s / (n - 1) * 1e3)
