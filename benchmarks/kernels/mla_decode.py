"""Multi-head latent attention (DeepSeek-V2/V3): KV bytes, and the absorbed vs the naive form (docs/benchmarks.md).

    flock /tmp/treeattn-bench.lock python benchmarks/kernels/mla_decode.py --context 8192 16384 32768 65536 --heads 16

1. KV cache bytes per token and per rank (--bytes-context tokens over p ranks), DeepSeek-V3's latent
   cache (61 layers x (512 + 64), bf16) beside GQA and MHA models of the same hidden size 7168 and
   depth, read from real ShardedKVCache objects on the "meta" device (no memory).
2. Decode latency of one MLA layer at DeepSeek-V3's per-head sizes (kv_lora_rank 512,
   qk_rope_head_dim 64, qk_nope_head_dim 128, v_head_dim 128, q_lora_rank 1536, hidden 7168) with
   --heads query heads (V3 has 128; fewer keep the naive form's runs short on a CPU), float32, one
   process, over a latent cache of C random entries:
     absorbed: q projected into the latent space, MQA over the entries (D = 576, Dv = 512);
     naive:    the entries decompressed through kv_b_proj every step, MHA over them;
     mha-cache: what a cache of decompressed per-head K/V would cost to attend (no decompression,
               H x (192 + 128) numbers stored per token instead of 576): the memory-for-time alternative.
   Each row: median of --repeats steps (one token through the layer: projections, RoPE, attention,
   output projection) after one warm-up.
3. Prefill of S queries over S keys (one chunk, one device): absorbed vs naive, and which one
   treeattn.models.deepseek.prefers_naive picks.
"""

from __future__ import annotations

import json
import platform
import statistics
import time

import torch

from treeattn.bench import harness
from treeattn.cache import ShardedKVCache
from treeattn.models.attention import LocalAttention
from treeattn.models.deepseek import DeepseekConfig, MLAttention, prefers_naive, rope_cos_sin, rope_parameters
from treeattn.models.llama import LlamaConfig
from treeattn.ops import attention

V3 = dict(vocab_size=129280, hidden_size=7168, intermediate_size=18432, num_layers=61, num_heads=128, kv_lora_rank=512,
          q_lora_rank=1536, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)


def kv_bytes_rows(context: int, world_sizes: list[int]) -> list[dict]:
    """Bytes per token and per rank of the V3 latent cache and of GQA / MHA caches of the same width and depth."""
    models = {
        "DeepSeek-V3 MLA (61 x (512 + 64))": DeepseekConfig(**V3),
        "GQA, 8 KV heads x 128 (61 layers)": LlamaConfig(vocab_size=V3["vocab_size"], hidden_size=7168, intermediate_size=18432,
                                                          num_layers=61, num_heads=56, num_kv_heads=8, head_dim=128),
        "MHA, 56 heads x 128 (61 layers)": LlamaConfig(vocab_size=V3["vocab_size"], hidden_size=7168, intermediate_size=18432,
                                                        num_layers=61, num_heads=56, num_kv_heads=56, head_dim=128),
    }
    rows = []
    for name, c in models.items():
        row = {"model": name}
        for p in world_sizes:
            cache = ShardedKVCache(num_layers=c.num_layers, num_kv_heads=c.num_kv_heads, head_dim=c.head_dim,
                                   value_dim=c.cache_value_dim, capacity=context, rank=0, world_size=p, block_size=256,
                                   dtype=torch.bfloat16, device="meta")
            row["bytes_per_token"] = cache.bytes_per_token
            row[f"bytes_per_rank_p{p}"] = cache.bytes_per_token * cache.local_capacity
        rows.append(row)
    return rows


def layer_config(heads: int) -> DeepseekConfig:
    return DeepseekConfig(**{**V3, "num_layers": 1, "num_heads": heads, "vocab_size": 16, "intermediate_size": 16})


def make_layer(config: DeepseekConfig) -> MLAttention:
    layer = MLAttention(config, 0)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            p.copy_(torch.ones_like(p) if name.endswith("norm.weight") else torch.randn(p.shape, generator=generator) * 0.02)
    return layer.eval()


def latent_store(context: int, config: DeepseekConfig, new: int):
    """kv_store over `context` random cached entries plus the pass's `new` ones (appended, not kept)."""
    generator = torch.Generator().manual_seed(1)
    cached = torch.randn(1, context, 1, config.head_dim, generator=generator)
    positions = torch.arange(context + new)[None]

    def store(layer, k_new, v_new):
        k = torch.cat((cached, k_new), dim=1)
        return k, k[..., : config.kv_lora_rank], positions

    return store


def time_call(fn, repeats: int) -> float:
    fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def run_layer(layer, config, context: int, num_queries: int, form: str):
    x = torch.randn(1, num_queries, config.hidden_size, generator=torch.Generator().manual_seed(2))
    positions = torch.arange(context, context + num_queries)[None]
    inv_freq, factor = rope_parameters(config)
    cos, sin = rope_cos_sin(inv_freq, factor, positions, torch.float32)
    store = latent_store(context, config, num_queries)
    return lambda: layer(x, positions, cos, sin, store, LocalAttention(), form)


def mha_cache_step(config: DeepseekConfig, context: int):
    """Attention alone over a cache of decompressed per-head K (192) and V (128): one query per head."""
    H = config.num_heads
    generator = torch.Generator().manual_seed(3)
    q = torch.randn(1, 1, H, config.qk_head_dim, generator=generator)
    k = torch.randn(1, context + 1, H, config.qk_head_dim, generator=generator)
    v = torch.randn(1, context + 1, H, config.v_head_dim, generator=generator)
    return lambda: attention(q, k, v)


def main() -> None:
    parser = harness.parser(__doc__, context=[8192, 16384, 32768, 65536], repeats=3, threads=torch.get_num_threads(),
                            helps={"context": "context lengths in tokens"})
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--prefill", type=int, nargs="*", default=[64, 256, 1024])
    parser.add_argument("--bytes-context", type=int, default=131072)
    args = harness.parse_args(parser)
    torch.set_num_threads(args.threads)
    report = {"machine": f"{platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}",
              "kv_bytes": kv_bytes_rows(args.bytes_context, [1, 2, 4, 8])}
    config = layer_config(args.heads)
    layer = make_layer(config)
    decode = []
    with torch.inference_mode():
        for context in args.context:
            row = {"context": context}
            for form in ("absorbed", "naive"):
                row[f"{form}_s"] = time_call(run_layer(layer, config, context, 1, form), args.repeats)
            row["mha_cache_attention_s"] = time_call(mha_cache_step(config, context), args.repeats)
            decode.append(row)
            print(json.dumps(row), flush=True)
        prefill = []
        for n in args.prefill:
            row = {"queries": n, "keys": n, "auto_picks": "naive" if prefers_naive(n, n, config) else "absorbed"}
            for form in ("absorbed", "naive"):
                row[f"{form}_s"] = time_call(run_layer(layer, config, 0, n, form), max(1, args.repeats - 1))
            prefill.append(row)
            print(json.dumps(row), flush=True)
    report.update(heads=args.heads, decode=decode, prefill=prefill)
    for row in report["kv_bytes"]:
        print(json.dumps(row))
    harness.write_output(args.output, report)


if __name__ == "__main__":
    main()
