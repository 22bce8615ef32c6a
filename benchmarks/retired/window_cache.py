"""Window-layer bookkeeping per decode step at Gemma 3 270M's shapes (15 window layers, W = 512, one KV
head of 256, float32): the WindowKVCache before the ring (commit a1aa4b9: cat + clone of the window,
then a padded copy, per layer per step) against the ring (in place), in one process, alternating.

    python3 benchmarks/retired/window_cache.py      # needs the git history (reads the old module with git show)
"""
import importlib.util
import subprocess
import tempfile
import time

import torch

from treeattn.cache.window import WindowKVCache as Ring

source = subprocess.run(["git", "show", "a1aa4b9:src/treeattn/cache/window.py"], capture_output=True, text=True,
                        check=True).stdout
with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
    f.write(source)
spec = importlib.util.spec_from_file_location("window_old", f.name)
old = importlib.util.module_from_spec(spec)
spec.loader.exec_module(old)
torch.set_num_threads(1)
W, H, D, L = 512, 1, 256, 15
def run(cls, steps=40, batch=1):
    c = cls({i: W for i in range(L)}, num_kv_heads=H, head_dim=D)
    kw = (lambda start, n: dict(keep_from=start + n)) if cls is old.WindowKVCache else (lambda start, n: {})
    for s in range(batch):
        for layer in range(L):
            c.extend(layer, s, 0, torch.randn(600, H, D), torch.randn(600, H, D), **kw(0, 600))
    new = torch.randn(1, H, D)
    pos = 600
    t = time.perf_counter()
    for _ in range(steps):
        for layer in range(L):
            rows = [c.extend(layer, s, pos, new, new, **kw(pos, 1)) for s in range(batch)]
            width = max(p.numel() for _, _, p in rows)
            if cls is old.WindowKVCache or batch > 1:
                k = new.new_zeros(batch, width, H, D)
                v = new.new_zeros(batch, width, H, D)
                for b, (kb, vb, pb) in enumerate(rows):
                    k[b, :pb.numel()] = kb
                    v[b, :pb.numel()] = vb
        pos += 1
    return (time.perf_counter() - t) / steps * 1e3
for batch in (1, 4):
    a, b = [], []
    for _ in range(3):
        a.append(run(old.WindowKVCache, batch=batch))
        b.append(run(Ring, batch=batch))
    print(f"batch {batch}: old {min(a):.2f} ms/step, ring {min(b):.2f} ms/step, ratio {min(b)/min(a):.2f}")
