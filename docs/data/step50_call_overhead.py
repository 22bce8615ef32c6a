"""Per-call CPU cost of a decode step's wrappers, on the treeattn that PYTHONPATH names (run it on main and on the
branch, alternately): thread CPU time, best of 5 rounds, one torch thread, under inference_mode.

    PYTHONPATH=$PWD/src python3 docs/data/step50_call_overhead.py MODEL.gguf [int8|float32]

- attention per layer: the paged kernel over 2 blocks of 16 float16 keys (the kernel's own work ~nothing) as the
  engine calls it: main paged_decode_attention per layer; a branch with ops.paged_decode.layer_call, that call
- the packed model (weights packed, q/k/v and gate/up fused, the activation format given) of MODEL: one layer's
  fused q/k/v, o_proj, input RMSNorm, and the whole forward of one token with attention stubbed out (30 layers)
"""
import sys
import time

import torch

from treeattn.cache.paged import PagedKVCache
from treeattn.engine.worker.rank import load_model
from treeattn.models.packed import fuse_projections, set_activation_format
from treeattn.ops import paged_decode as pd

torch.set_num_threads(1)


def best_us(f, n=3000, rounds=5):
    f()
    best = float("inf")
    for _ in range(rounds):
        start = time.thread_time()
        for _ in range(n):
            f()
        best = min(best, (time.thread_time() - start) / n * 1e6)
    return best


with torch.inference_mode():
    cache = PagedKVCache(num_layers=2, num_kv_heads=3, head_dim=64, num_blocks=8, block_size=16, dtype=torch.float16,
                         compute_dtype=torch.float32)
    cache.arena.normal_()
    layout = pd.PagedDecodeLayout(torch.tensor([[0, 1]]), torch.arange(32)[None], torch.tensor([[31]]), block_size=16)
    q = torch.randn(1, 1, 9, 64)
    k, v = cache.blocks(1)
    if hasattr(pd, "layer_call"):
        call = pd.layer_call(q, k, v, layout)
        print(f"attention per layer (layer_call) {best_us(lambda: call(q, k, v, None)):.2f} us")
    else:
        print(f"attention per layer (paged_decode_attention) {best_us(lambda: pd.paged_decode_attention(q, k, v, layout)):.2f} us")
    model = load_model(sys.argv[1], torch.float32, weight_format="packed")
    fuse_projections(model)
    set_activation_format(model, sys.argv[2] if len(sys.argv) > 2 else "int8")
    layer = model.layers[3]
    x = torch.randn(1, 1, model.config.hidden_size)
    print(f"fused q/k/v {best_us(lambda: layer.self_attn.fused(x)):.2f} us")
    print(f"o_proj {best_us(lambda: layer.self_attn.o_proj(x)):.2f} us")
    print(f"input RMSNorm {best_us(lambda: layer.input_layernorm(x)):.2f} us")
    tokens, positions = torch.tensor([[5]]), torch.tensor([[100]])
    forward = lambda: model(tokens, positions, lambda layer, k, v: (k, v, None),  # noqa: E731
                            lambda q, k, v, *, q_pos, kv_pos, window: q.clone())
    print(f"forward without attention {best_us(forward, n=50) / 1e3:.3f} ms")
