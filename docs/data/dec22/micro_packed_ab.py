"""In one process, alternated: main's call path of a packed decode product (packed_matmul / kernel_matmul with every
lookup per call) against this branch's (the layer's bound serial kernel). SmolLM2 layer 0, S=1, int8 activations,
thread CPU us per call, 9 alternated rounds of 2000 calls; the outputs are compared bit for bit first.
PYTHONPATH=src python3 docs/data/dec22/micro_packed_ab.py"""
import statistics, subprocess, time, torch
from treeattn.models.loader import load_model
from treeattn.models.packed import fuse_projections, pack_arena, set_activation_format
from treeattn.ops.packed_linear import kernel_matmul, packed_matmul
torch.set_num_threads(1)
path = subprocess.run(['treeattn', 'models', '--path', 'smollm2'], capture_output=True, text=True).stdout.strip()
model = load_model(path, weight_format="packed", with_tokenizer=False)
fuse_projections(model); pack_arena(model); set_activation_format(model, "int8")
L = model.layers[0]
h, g = torch.randn(1, 1, 576), torch.randn(1, 1, 1536)
fq = L.self_attn.__dict__["fused"]

def main_fused(x):  # main's FusedPacked.__call__ body
    v = fq.whole._cached()
    out = kernel_matmul(x, v.fmt, v.qs, v.arrays, 1, fq.parts[0].activations)
    return tuple(torch.from_numpy(out[..., a:b]) for a, b in fq.bounds)

def main_linear(layer, x):  # main's PackedLinear.forward
    v = layer._cached()
    return packed_matmul(x, v.fmt, v.qs, v.d, v.m, layer.bias, arrays=v.arrays, activations=layer.activations,
                         prefill_dtype=layer.prefill_dtype)

pairs = {"qkv fused": (lambda: main_fused(h), lambda: fq(h)),
         "o_proj": (lambda: main_linear(L.self_attn.o_proj, h), lambda: L.self_attn.o_proj(h)),
         "down_proj": (lambda: main_linear(L.mlp.down_proj, g), lambda: L.mlp.down_proj(g))}
with torch.inference_mode():
    for name, (a, b) in pairs.items():
        ra, rb = a(), b()
        same = all(torch.equal(x, y) for x, y in zip(ra if isinstance(ra, tuple) else (ra,), rb if isinstance(rb, tuple) else (rb,)))
        times = {"main": [], "branch": []}
        for _ in range(9):
            for label, f in (("main", a), ("branch", b)):
                s = time.thread_time_ns()
                for _ in range(2000):
                    f()
                times[label].append((time.thread_time_ns() - s) / 2000 / 1e3)
        ratios = [y / x for x, y in zip(times["main"], times["branch"])]
        print(f"{name:10s} bitwise_equal={same} main median {statistics.median(times['main']):6.2f} us, branch "
              f"{statistics.median(times['branch']):6.2f} us, branch/main median ratio {statistics.median(ratios):.3f} "
              f"(range {min(ratios):.3f}-{max(ratios):.3f})", flush=True)
print("load", open("/proc/loadavg").read().split()[:3])
