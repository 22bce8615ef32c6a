"""One rank's CPU time per decode step, without its peer: what a Helix T=2 rank and a sequence-only rank of
2 ranks run for one token, split into the packed matmuls (the LM head's share apart), attention and the
rest (norms, RoPE, activations, cache writes, module calls, the collectives' own work: Python and small ops).

    python benchmarks/parallel/helix_rank_cpu.py /tmp/llama1b.Q4_0.gguf --context 4096 16384

One process, one torch thread. The rank's share of the file is loaded packed as an engine rank loads it
(`HelixLayout(2, 2, 0)`'s cuts; the sequence-only rank: the whole model, its LM head half the vocabulary),
fused as the engine fuses it, and connected to a 2-rank SharedMemoryGroup over an anonymous mapping whose
other rank's sequence number is far ahead, so no collective ever waits (the sums add the absent rank's zero
slot: the values are not the model's, the work is the rank's). The rank's share of a --context cache (a T=2 rank:
all positions of its 4 KV heads; a sequence-only rank: half the positions of all 8) is filled with random keys and
values, as a prefill would leave it without running one (decode's cost depends on the cache's length, not its
values), 2 decode steps warm the kernels up, then --max-new-tokens steps of one token each are timed in thread CPU time
(preemption by other processes does not count; a loaded machine's cache and memory contention does). What a
measured 2-rank step takes beyond this figure is waiting: the peer's imbalance, the handshake, the plan.
"""

from __future__ import annotations

import mmap
import time

import torch

from treeattn.bench import harness

WARMUP = 2  # decode steps run before the timed ones


def _rank_model(path: str, tp: int | None, activation_format: str):
    from treeattn.engine.worker.rank import load_model
    from treeattn.engine.worker.tensor_parallel import HelixLayout, connect, tensor_parallel_cuts
    from treeattn.models.loader import read_config
    from treeattn.models.packed import fuse_projections, set_activation_format
    from treeattn.parallel.shared_memory import _LINE, SharedMemoryGroup

    layout = HelixLayout(2, tp, 0) if tp else None
    model = load_model(path, None, None, "packed", layout)
    if layout is not None:
        capacity = max(1 << 18, 4 * -(-read_config(path).vocab_size // 2))
        mapping = mmap.mmap(-1, 2 * _LINE + 2 * 2 * capacity)
        group = SharedMemoryGroup(None, mapping, rank=0, size=2, capacity_bytes=capacity, timeout_s=10)
        memoryview(mapping).cast("q")[_LINE // 8] = 1 << 60  # the absent rank is always ahead: nothing waits
        connect(model, layout, tensor_parallel_cuts(model.config, layout), group)
    fuse_projections(model)
    set_activation_format(model, activation_format)
    return model


def _fill(cache, layers: int, keys: int) -> None:
    """`keys` positions of random keys and values (normal, seeded) in every layer of `cache`: a rank's share
    of the context, as a prefill would leave it (decode's cost depends on the cache's length, not its values)."""
    g = torch.Generator().manual_seed(0)
    k = torch.randn(1, keys, cache.num_kv_heads, cache.head_dim, generator=g)
    v = torch.randn(1, keys, cache.num_kv_heads, cache.head_dim, generator=g)
    store = cache.update(cache.extend(torch.arange(keys)[None]))
    for layer in range(layers):
        store(layer, k, v)


def _measure(model, context: int, new_tokens: int, tp: int | None) -> dict:
    import treeattn.models.packed as packed
    from treeattn.cache import ShardedKVCache
    from treeattn.engine.worker.tensor_parallel import HelixLayout, local_heads
    from treeattn.models import LocalAttention

    c = model.config
    kv_heads = local_heads(c, HelixLayout(2, tp, 0))[1] if tp else c.num_kv_heads
    cache = ShardedKVCache(num_layers=c.num_layers, num_kv_heads=kv_heads, head_dim=c.head_dim,
                           capacity=(context if tp else context // 2) + new_tokens + WARMUP)
    vocab = None if tp else slice(0, -(-c.vocab_size // 2))  # sequence-only: the runner's LM head share of rank 0
    spent = dict.fromkeys(("matmul", "lm_head", "attention"), 0)
    original = packed.packed_matmul
    where = ["matmul"]

    def timed_matmul(*args, **kwargs):
        start = time.thread_time_ns()
        out = original(*args, **kwargs)
        spent[where[0]] += time.thread_time_ns() - start
        return out

    local = LocalAttention()

    def attend(*args, **kwargs):
        start = time.thread_time_ns()
        out = local(*args, **kwargs)
        spent["attention"] += time.thread_time_ns() - start
        return out

    packed.packed_matmul = timed_matmul
    try:
        with torch.inference_mode():
            _fill(cache, c.num_layers, context if tp else context // 2)
            total = 0
            for i in range(new_tokens + WARMUP):
                if i == WARMUP:  # the decode-shaped kernels compiled (or loaded from numba's cache) in the first steps
                    total, spent = 0, dict.fromkeys(spent, 0)
                pos = torch.tensor([[context + i]])
                start = time.thread_time_ns()
                where[0] = "matmul"
                hidden = model(torch.tensor([[1000 + i]]), pos, cache.update(cache.extend(pos)), attend)
                where[0] = "lm_head"
                model.logits(hidden[:, -1], vocab)
                total += time.thread_time_ns() - start
    finally:
        packed.packed_matmul = original
    ms = {k: v / new_tokens / 1e6 for k, v in spent.items()}
    ms["step"] = total / new_tokens / 1e6
    ms["rest"] = ms["step"] - ms["matmul"] - ms["lm_head"] - ms["attention"]
    return ms


def main() -> None:
    p = harness.parser(__doc__, model="required", context=[4096], max_new_tokens=12)
    p.add_argument("--layouts", nargs="+", default=["tp2", "seq"], choices=["tp2", "seq"])
    p.add_argument("--activation-format", default="float32", choices=["float32", "int8"],
                   help="how the packed weights multiply the activations (EngineConfig.activation_format)")
    args = harness.parse_args(p)
    torch.set_num_threads(1)
    rows = []
    lines = ["| context | rank of | CPU ms / step | packed matmuls | LM head share | attention | the rest |",
             "|---|---|---|---|---|---|---|"]
    print(lines[0], flush=True)
    for layout in args.layouts:
        tp = {"tp2": 2, "seq": None}[layout]
        model = _rank_model(args.model, tp, args.activation_format)
        for context in args.context:
            ms = _measure(model, context, args.max_new_tokens, tp)
            rows.append({"layout": layout, "context": context, **ms})
            lines.append(f"| {context} | {layout} | {ms['step']:.1f} | {ms['matmul']:.1f} | {ms['lm_head']:.1f} | "
                         f"{ms['attention']:.1f} | "
                         f"{ms['rest']:.1f} |")
            print(lines[-1], flush=True)
    harness.write_output(args.output, rows, "\n".join(lines))


if __name__ == "__main__":
    main()
