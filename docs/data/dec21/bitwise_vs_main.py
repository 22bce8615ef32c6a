# dec21: this branch's paged kernel against main's (git show main:src/treeattn/ops/paged_cpu_kernel.py > /tmp/dec21_main_kernel.py), bitwise; PYTHONPATH=src python3 docs/data/dec21/bitwise_vs_main.py
# (remove /tmp/__pycache__/dec21_main_kernel* first: numba caches the copy under the module name it was loaded as)
import importlib.util, sys, numpy as np, torch
from treeattn.ops import paged_cpu_kernel as new
spec = importlib.util.spec_from_file_location("old_kernel", "/tmp/dec21_main_kernel.py"); old = importlib.util.module_from_spec(spec); spec.loader.exec_module(old)
rng = np.random.default_rng(0)
for (H, G, D), dt, ctx, win in [((3, 3, 64), np.int16, 4100, 0), ((1, 4, 256), np.int16, 4000, 512), ((3, 3, 64), np.float32, 1000, 0), ((2, 3, 16), np.uint16, 700, 100)]:
    BS = 256; nb = -(-ctx // BS)
    kf = rng.standard_normal((nb + 1, BS, H, D)).astype(np.float32) * 2
    vf = rng.standard_normal((nb + 1, BS, H, D)).astype(np.float32)
    if dt == np.int16:
        k = torch.from_numpy(kf).half().view(torch.int16).numpy(); v = torch.from_numpy(vf).half().view(torch.int16).numpy()
    elif dt == np.uint16:
        k = torch.from_numpy(kf).bfloat16().view(torch.int16).numpy().view(np.uint16); v = torch.from_numpy(vf).bfloat16().view(torch.int16).numpy().view(np.uint16)
    else:
        k, v = kf, vf
    q = rng.standard_normal((2, H, G, D)).astype(np.float32)
    table = np.arange(nb, dtype=np.int64)[None].repeat(1, 0)
    kv_pos = np.arange(nb * BS, dtype=np.int64)[None]; kv_pos[0, ctx:] = 1 << 62
    row_seq = np.zeros(2, np.int64); q_pos = np.array([ctx - 1, ctx - 7], np.int64)
    for threads in (1, 2):
        res = []
        for mod in (new, old):
            out = np.empty((2, H, G, D), np.float32); lse = np.empty((2, H, G), np.float32)
            mod.attend(threads, q, k, v, mod.NO_SCALES, mod.NO_SCALES, D, 0.125, table, kv_pos, row_seq, q_pos, win, 2 if threads > 1 else 1, out, lse)
            res.append((out, lse))
        print((H, G, D), dt.__name__, ctx, win, threads, "equal" if all(np.array_equal(a, b) for a, b in zip(res[0], res[1])) else "DIFFER", flush=True)
