import sys, time, os, torch, treeattn as ta
from treeattn.bench.harness import default_model
path = sys.argv[1] if len(sys.argv) > 1 and sys.argv[1] != "-" else default_model()
n = int(sys.argv[2]) if len(sys.argv) > 2 else 100
ctx = int(sys.argv[3]) if len(sys.argv) > 3 else 4084
extra = dict(a.split("=") for a in sys.argv[4:])
import random
rng = random.Random(0)
ids = [1] + [rng.randrange(100, 20000) for _ in range(ctx - 1)]
with ta.Engine(path, nproc=1, weight_format="packed", **extra) as e:
    r = e.generate([ids], max_new_tokens=2, temperature=0.0, ignore_eos=True)[0]
    open("/tmp/cpu50/ready", "w").write(str(os.getpid())); time.sleep(3)
    r = e.generate([ids], max_new_tokens=n, temperature=0.0, ignore_eos=True)[0]
    print("ms/token", r.decode_s / (n - 1) * 1e3, r.token_ids[:8], flush=True)
