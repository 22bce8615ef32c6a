# dec21: run as `PYTHONPATH=src python3 docs/data/dec21/kernel_parts.py` (output: kernel_parts.txt, with the load)
# (the branch kernel; no prefetch-ahead rows passed: in cache; max+exp uses _row_max)
"""Per-block cost of the paged kernel's parts, SmolLM2 heads (3 KV x 3 q heads x 64), float16 blocks, one thread,
in cache (the same 8 blocks over and over), thread CPU time: ns per key of one layer."""
import time, numpy as np, torch
from numba import njit
from treeattn.ops import paged_cpu_kernel as K
BS, H, G, D = 256, 3, 3, 64
NB = 8
rng = np.random.default_rng(0)
k = torch.from_numpy(rng.standard_normal((NB, BS, H, D)).astype(np.float32)).half().view(torch.int16).numpy()
v = torch.from_numpy(rng.standard_normal((NB, BS, H, D)).astype(np.float32)).half().view(torch.int16).numpy()
q = rng.standard_normal((1, H, G, D)).astype(np.float32)
dims, (heads, groups) = K.head_dim_tag(D, D), K.head_shape_tag(H, G)
kv_pos = np.arange(NB * BS, dtype=np.int64)[None]

@njit(fastmath={"reassoc", "contract"})
def scores_only(q, k, reps, dims, heads, groups):
    scores = np.zeros((H, G, BS + 16), np.float32); visible = np.ones(BS, np.bool_)
    for _ in range(reps):
        for blk in range(k.shape[0]):
            K._block_scores(q, 0, k[blk], k, K.NO_SCALES, blk, visible, scores, np.float32(0.125), dims, heads, groups, k[blk, :0])
    return scores[0, 0, 0]

@njit(fastmath={"reassoc", "contract"})
def max_exp(reps):
    scores = np.random.rand(H, G, BS + 16).astype(np.float32); bits = np.empty(BS, np.int32)
    m = np.zeros((H, G), np.float32)
    for _ in range(reps):
        for blk in range(NB):
            for h in range(H):
                for g in range(G):
                    top = K._row_max(scores, h, g, BS, m[h, g])
                    m[h, g] = top
                    K._exp_shifted(scores[h, g, :BS], m[h, g] + np.float32(1.0), bits)
    return m[0, 0]

@njit(fastmath={"reassoc", "contract"})
def values_only(v, reps, groups):
    scores = np.random.rand(H, G, BS + 16).astype(np.float32) * np.float32(1e-3); visible = np.ones(BS, np.bool_)
    acc = np.zeros((H, G, D), np.float32); lsum = np.zeros((H, G), np.float32)
    for _ in range(reps):
        for blk in range(v.shape[0]):
            K._block_values(v[blk], v, K.NO_SCALES, blk, visible, scores, acc, lsum, D, groups, v[blk, :0])
    return acc[0, 0, 0]

@njit
def visible_only(kv_pos, reps):
    visible = np.empty(BS, np.bool_); s = 0
    for _ in range(reps):
        for j in range(NB):
            seen = 0
            for t in range(BS):
                kp = kv_pos[0, j * BS + t]
                visible[t] = kp <= 100000 and not (0 > 0 and 100000 - kp >= 0)
                seen += visible[t]
            s += seen
    return s

for name, fn in [("scores", lambda r: scores_only(q, k, r, dims, heads, groups)), ("max+exp", max_exp),
                 ("values", lambda r: values_only(v, r, groups)), ("visible", lambda r: visible_only(kv_pos, r))]:
    fn(1)
    best = []
    for _ in range(5):
        t = time.thread_time(); fn(200); best.append((time.thread_time() - t) / (200 * NB * BS) * 1e9)
    print(f"{name:8s} ns/key-layer: min {min(best):.2f} median {sorted(best)[2]:.2f}", flush=True)

@njit(fastmath={"reassoc", "contract"})
def tiles_only(v, reps, groups):
    scores = np.random.rand(H, G, BS + 16).astype(np.float32) * np.float32(1e-3)
    acc = np.zeros((H, G, D), np.float32)
    for _ in range(reps):
        for blk in range(v.shape[0]):
            vb = v[blk]
            for t0 in range(0, BS, 4):
                for h in range(H):
                    K._value_tile(acc, h, 0, vb, t0, scores, groups)
    return acc[0, 0, 0]

@njit(fastmath={"reassoc", "contract"})
def lsum_only(reps):
    scores = np.random.rand(H, G, BS + 16).astype(np.float32) * np.float32(1e-3)
    lsum = np.zeros((H, G), np.float32)
    for _ in range(reps):
        for blk in range(NB):
            for t0 in range(0, BS, 4):
                for h in range(H):
                    for g in range(G):
                        total = np.float32(0.0)
                        for t in range(t0, t0 + 4):
                            total += scores[h, g, t]
                        lsum[h, g] += total
    return lsum[0, 0]

for name, fn in [("tiles", lambda r: tiles_only(v, r, groups)), ("lsum", lsum_only)]:
    fn(1)
    best = []
    for _ in range(5):
        t = time.thread_time(); fn(200); best.append((time.thread_time() - t) / (200 * NB * BS) * 1e9)
    print(f"{name:8s} ns/key-layer: min {min(best):.2f} median {sorted(best)[2]:.2f}", flush=True)
