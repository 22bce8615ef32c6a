"""python benchmarks/engine/activation_format_engine.py MODEL.gguf 48 5  (issue 50) -- Engine A/B, alternated in one process:
decode ms/token, packed weights, activation_format float32 vs int8 (64-token prompt)."""
import sys
import os
import json
import numpy as np
import treeattn as ta
path, n, rounds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
engines = {a: ta.Engine(path, nproc=1, weight_format="packed", activation_format=a,
                        max_batch_size=1) for a in ("float32", "int8")}
t = {a: [] for a in engines}
print("# load before", os.getloadavg())
for r in range(rounds):
    for a, e in engines.items():
        res = e.generate([[1] * 64], max_new_tokens=n, temperature=0.0, ignore_eos=True)[0]
        t[a].append(res.decode_s / (n - 1) * 1e3)
for e in engines.values():
    e.close()
f, i = np.array(t["float32"]), np.array(t["int8"])
print(json.dumps({"model": os.path.basename(path), "float32_ms": [round(v, 2) for v in f], "int8_ms": [round(v, 2) for v in i],
                  "min_ratio": round(i.min() / f.min(), 3), "median_ratio": round(float(np.median(i / f)), 3)}))
print("# load after", os.getloadavg())
