"""Thread CPU us per call: SmolLM2 layer 0's fused q/k/v, o_proj and down_proj, S=1, int8 activations; run under
PYTHONPATH=/work/main/src and PYTHONPATH=src alternately (docs/data/dec22/micro_packed.sh)."""
import subprocess, sys, time, torch
from treeattn.models.loader import load_model
from treeattn.models.packed import fuse_projections, pack_arena, set_activation_format
torch.set_num_threads(1)
path = subprocess.run(['treeattn', 'models', '--path', 'smollm2'], capture_output=True, text=True).stdout.strip()
model = load_model(path, weight_format="packed", with_tokenizer=False)
fuse_projections(model); pack_arena(model); set_activation_format(model, "int8")
L = model.layers[0]
h = torch.randn(1, 1, 576); g = torch.randn(1, 1, 1536)
def t(name, f, n=3000):
    f(); f()
    best = []
    for _ in range(3):
        s = time.thread_time_ns()
        for _ in range(n):
            f()
        best.append((time.thread_time_ns() - s) / n / 1e3)
    print(f"{sys.argv[1]:6s} {name:20s} min {min(best):7.2f} us  runs {' '.join(f'{b:.2f}' for b in best)}", flush=True)
with torch.inference_mode():
    fq = L.self_attn.__dict__["fused"]
    t("qkv fused", lambda: fq(h))
    t("o_proj", lambda: L.self_attn.o_proj(h))
    t("down_proj", lambda: L.mlp.down_proj(g))
    t("rms_norm module", lambda: L.input_layernorm(h))
