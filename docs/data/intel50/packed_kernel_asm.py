import sys, re, numpy as np
from treeattn.ops import packed_cpu_kernel as k
out = []
for f, fn in [('q4_1', k._q4_1_serial), ('q4_0', k._q4_0_serial), ('q8_0', k._q8_0_serial), ('q4_1', k._q4_1_parallel)]:
    N, K = 64, 576
    qs = np.random.randint(0, 255, (N, K // 32, 16 if f != 'q8_0' else 32)).astype(np.uint8 if f != 'q8_0' else np.int8)
    d = np.random.rand(N, K // 32).astype(np.float32); x = np.random.rand(1, K).astype(np.float32); out_ = np.zeros((1, N), np.float32)
    fn(x, qs, d, d.copy(), out_, 2)
    a = fn.inspect_asm(fn.signatures[0])
    ins = [l.split('#')[0].strip() for l in a.splitlines() if l.startswith('\t') and not l.strip().startswith('.')]
    ins = [re.sub(r'0x[0-9a-f]+|\.LBB\S+|\.LCPI\S+|_ZN\S+|__numba\S+', 'X', i) for i in ins]
    out.append(f"{f} {fn.__name__}: {len(ins)} instructions, zmm {a.count('zmm')} ymm {a.count('ymm')}")
    open(f"/tmp/intel50_asm_{sys.argv[1]}_{fn.__name__}.s", "w").write("\n".join(ins))
print("\n".join(out))
