# dec21: the scalar running-max loop of the paged kernel (mx) against 16 independent lanes (mx2): asm counts and ns per block of 9 rows x 256 scores; `python3 docs/data/dec21/max_loop_asm.py`
import numpy as np, numba, re, time
from numba import njit
@njit(fastmath={"reassoc", "contract"})
def mx(scores, m):
    H, G, BS = scores.shape[0], scores.shape[1], 256
    for h in range(H):
        for g in range(G):
            top = m[h, g]
            for t in range(BS):
                if scores[h, g, t] > top:
                    top = scores[h, g, t]
            m[h, g] = top

@njit(fastmath={"reassoc", "contract"})
def mx2(scores, m):
    H, G, BS = scores.shape[0], scores.shape[1], 256
    lanes = np.empty(16, dtype=np.float32)
    for h in range(H):
        for g in range(G):
            for l in range(16):
                lanes[l] = m[h, g]
            for t0 in range(0, BS - BS % 16, 16):
                for l in range(16):
                    x = scores[h, g, t0 + l]
                    lanes[l] = x if x > lanes[l] else lanes[l]
            top = m[h, g]
            for t in range(BS - BS % 16, BS):
                if scores[h, g, t] > top:
                    top = scores[h, g, t]
            for l in range(16):
                if lanes[l] > top:
                    top = lanes[l]
            m[h, g] = top
s = np.random.rand(3, 3, 272).astype(np.float32); s[0,0,5]=np.nan; s[1,1,:]=-np.inf
m = np.full((3, 3), -np.inf, np.float32); m2 = m.copy()
mx(s, m); mx2(s, m2); print(m, m2, np.array_equal(m, m2))
for f in (mx, mx2):
    asm = list(f.inspect_asm().values())[0]
    print("zmm", len(re.findall(r"zmm", asm)), "ymm", len(re.findall(r"ymm", asm)), "vmaxps", asm.count("vmaxps"), "vcmp", asm.count("vcmp"), "vmaxss", asm.count("vmaxss"))
    m = np.full((3, 3), -np.inf, np.float32)
    t = time.thread_time()
    for _ in range(20000): f(s, m)
    print((time.thread_time() - t) / 20000 * 1e9, "ns per block of 9 rows")
