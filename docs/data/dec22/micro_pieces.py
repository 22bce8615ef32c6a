"""Thread CPU us per call of the pieces of one SmolLM2 decode layer (S=1), each alone in a loop.
PYTHONPATH=src python3 docs/data/dec22/micro_pieces.py"""
import subprocess, time, torch, numpy as np
import torch.nn.functional as F
from treeattn.models.loader import load_model
from treeattn.models.packed import fuse_projections, pack_arena, set_activation_format
from treeattn.ops.packed_linear import kernel_arrays
torch.set_num_threads(1)
path = subprocess.run(['treeattn', 'models', '--path', 'smollm2'], capture_output=True, text=True).stdout.strip()
model = load_model(path, weight_format="packed", with_tokenizer=False)
fuse_projections(model); pack_arena(model); set_activation_format(model, "int8")
L = model.layers[0]
h = torch.randn(1, 1, 576)
def t(name, f, n=3000):
    f(); f()
    s = time.thread_time_ns()
    for _ in range(n):
        f()
    print(f"{name:40s} {(time.thread_time_ns() - s) / n / 1e3:8.2f} us", flush=True)
import treeattn.ops.packed_int8_kernel as k8
import treeattn.ops.rowwise_cpu_kernel as rk
with torch.inference_mode():
    fq = L.self_attn.__dict__["fused"]
    v = fq.whole._cached()
    xr = h.numpy().reshape(1, 576); out = np.empty((1, fq.whole.rows), np.float32)
    if 0: t("qkv fused call", lambda: fq(h))
    t("qkv kernel direct (serial dispatcher)", lambda: k8._KERNELS[v.fmt][False](xr, *v.arrays, out, 1))
    t("o_proj module call", lambda: L.self_attn.o_proj(h))
    if 0: t("mlp module call", lambda: L.mlp(h))
    t("rmsnorm module call", lambda: L.input_layernorm(h))
    o2 = np.empty((1, 576), np.float32); w = L.input_layernorm.weight.detach().numpy()
    t("rmsnorm kernel direct", lambda: rk.rms_norm(xr, w, 0.0, 1e-5, o2))
    a = torch.randn(1, 1, 576)
    t("torch add (1,1,576)", lambda: h + a)
    t("torch slice h[:, 0:1024]", lambda: h[:, 0:1024])
    g = torch.randn(1, 1, 1536)
    t("silu(g) * g", lambda: F.silu(g) * g)
    t("empty module call overhead (Identity)", lambda: torch.nn.Identity()(h))
    t("np.empty + from_numpy", lambda: torch.from_numpy(np.empty((1, 576), np.float32)))
    t("thread_time_ns", time.thread_time_ns)
    t("perf_counter", time.perf_counter)
    from treeattn.ops.rowwise import rms_norm, apply_rope
    ident = torch.nn.Identity()
    t("Identity module call (built once)", lambda: ident(h))
    wt = L.input_layernorm.weight
    t("rowwise.rms_norm function", lambda: rms_norm(h, wt, 1e-5))
    t("weight.detach().numpy()", lambda: wt.detach().numpy())
    t("numpy_rows(h)", lambda: h.numpy().reshape(-1, 576))
    q = torch.randn(1, 1, 9, 64); cs = torch.randn(1, 1, 64)
    t("rowwise.apply_rope q", lambda: apply_rope(q, cs, cs))
    t("torch.is_grad_enabled", torch.is_grad_enabled)
