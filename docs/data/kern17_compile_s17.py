"""First call of one kernel file in a fresh process with an empty numba cache: CPU seconds (compile + one call)."""
import sys, time, importlib.util, resource
import numpy as np, torch
f, model, dtype = sys.argv[1], sys.argv[2], sys.argv[3]
heads = {"smollm2": (3, 3, 64), "gemma3-270m": (1, 4, 256), "llama3.2-1b": (8, 4, 64)}
spec = importlib.util.spec_from_file_location("kc_" + f.split('/')[-1][:-3], f)
m = importlib.util.module_from_spec(spec); sys.modules[spec.name] = m; spec.loader.exec_module(m)
hkv, g, d = heads[model]; BS = 16; nb = 2
bits = {"float16": torch.int16, "bfloat16": torch.uint16, "float32": torch.float32}[dtype]
k, v = [torch.randn(nb, BS, hkv, d).to(getattr(torch, dtype)).view(bits).numpy() for _ in range(2)]
q = np.zeros((1, hkv, g, d), np.float32)
table = np.arange(nb, dtype=np.int64).reshape(1, nb); kv_pos = np.arange(nb * BS, dtype=np.int64).reshape(1, -1)
rs, qp = np.zeros(1, np.int64), np.array([nb * BS], np.int64)
out, lse = np.empty((1, hkv, g, d), np.float32), np.empty((1, hkv, g), np.float32)
c = resource.getrusage(resource.RUSAGE_SELF); t = time.perf_counter()
m.attend(1, q, k, v, m.NO_SCALES, m.NO_SCALES, d, d ** -0.5, table, kv_pos, rs, qp, 0, 1, out, lse)
e = resource.getrusage(resource.RUSAGE_SELF)
print(f"{f.split('/')[-1]} {model} {dtype}: first call {e.ru_utime + e.ru_stime - c.ru_utime - c.ru_stime:.1f} s CPU, {time.perf_counter() - t:.1f} s wall")
