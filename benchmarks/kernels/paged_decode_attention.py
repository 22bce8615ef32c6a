"""Decode attention per token over the engine's paged cache, against the floor of streaming K/V once.

    flock /tmp/treeattn-quiet.lock python benchmarks/kernels/paged_decode_attention.py --cases 4096x1 4096x8 16384x1 16384x8

SmolLM2-135M's attention shapes (9 query heads, 3 KV heads of 64, float32, blocks of 256 tokens),
one decode query per sequence, every sequence `context` keys. For each case, these take turns
--repeats times (the minimum of each is reported, so a machine whose load drifts weighs on all):

- engine, paged kernel: treeattn.engine.worker.batch.PagedBatch kv_store + attend of every layer (the
  engine's decode attention: ops.paged_decode over the blocks in place);
- engine, before: the same with the kernel switched off (gather or run-by-run ops.attention);
- ta.attention over contiguous (B, context, 3, 64) K and V;
- torch SDPA (enable_gqa=True) over the same contiguous K and V;
- K/V copy: copy_ of every layer's K and V into a preallocated buffer (read once, write once):
  the streaming floor the issue measures against;
- with --kv-dtypes bfloat16 float16: the engine's paged kernel over the same keys and values
  stored in 16 bits (the engine's --kv-cache-dtype; attention still in float32).

Figures are per token of a 30-layer model: the measured layers' time x 30 / layers (a case
whose cache would exceed --max-bytes measures fewer distinct layers; each still streams from
memory, far larger than the caches). Ratios are to the K/V copy of the same run.
"""

from __future__ import annotations

import json
import os
import platform
import time

import torch
import torch.nn.functional as F

import treeattn as ta
from treeattn.bench import harness
from treeattn.cache.blocks import BlockRef
from treeattn.cache.paged import PagedKVCache
from treeattn.engine.worker import batch as engine_batch
from treeattn.engine.scheduler import Chunk, StepPlan
from treeattn.models.attention import LocalAttention

MODEL_LAYERS, HQ, HKV, D, BS = 30, 9, 3, 64, 256


def run_case(context: int, batch: int, repeat: int, max_bytes: int, kv_dtypes: tuple[str, ...] = ()) -> dict:
    nb = context // BS
    layer_bytes = 2 * batch * context * HKV * D * 4
    layers = max(2, min(MODEL_LAYERS, max_bytes // ((2 + len(kv_dtypes)) * layer_bytes)))  # the arenas and the contiguous copies
    cache = PagedKVCache(num_layers=layers, num_kv_heads=HKV, head_dim=D, num_blocks=batch * nb, block_size=BS)
    cache.arena.normal_()
    # the same keys and values in a 16-bit arena per --kv-dtypes (attention in float32, as the engine's --kv-cache-dtype)
    caches = {"float32": cache}
    for name in kv_dtypes:
        caches[name] = PagedKVCache(num_layers=layers, num_kv_heads=HKV, head_dim=D, num_blocks=batch * nb, block_size=BS,
                                    dtype=getattr(torch, name), compute_dtype=torch.float32)
        caches[name].arena.copy_(cache.arena)
    tables = [[s * nb + b for b in range(nb)] for s in range(batch)]
    # every sequence has context - 1 keys and decodes the token at position context - 1
    plan = StepPlan(tuple(Chunk(s, (1,), context - 1, tuple(BlockRef(0, i) for i in t), None) for s, t in enumerate(tables)))
    q = torch.randn(1, batch, HQ, D)
    k_new = torch.randn(1, batch, HKV, D)

    @torch.inference_mode()
    def engine(paged: bool, kv_dtype: str = "float32"):
        saved = engine_batch.kernel_takes
        if not paged:
            engine_batch.kernel_takes = lambda *args: False
        try:
            batch_ = engine_batch.PagedBatch(plan, 0, caches[kv_dtype], LocalAttention(), combine=(None, "onepass", 1))
            for layer in range(layers):
                k, v, pos = batch_.kv_store(layer, k_new, k_new)
                batch_.attend(q, k, v, q_pos=None, kv_pos=pos, window=None)
        finally:
            engine_batch.kernel_takes = saved

    table = torch.tensor(tables)
    contiguous = [tuple(t.contiguous() for t in cache.gather(layer, table)) for layer in range(layers)]
    qb = q.view(batch, 1, HQ, D)
    dst = torch.empty_like(contiguous[0][0])

    def ta_attention():
        for k, v in contiguous:
            ta.attention(qb, k, v)

    def sdpa():
        for k, v in contiguous:
            F.scaled_dot_product_attention(qb.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), enable_gqa=True)

    def kv_copy():
        for k, v in contiguous:
            dst.copy_(k)
            dst.copy_(v)

    fns = {"engine, paged kernel": lambda: engine(True), "engine, before": lambda: engine(False),
           "ta.attention (contiguous)": ta_attention, "torch SDPA (enable_gqa)": sdpa, "K/V copy (floor)": kv_copy}
    for name in kv_dtypes:
        fns[f"engine, paged kernel, {name} KV"] = lambda name=name: engine(True, name)
    for fn in fns.values():
        fn()  # warm-up (the kernel's first call loads its compiled code)
    best = {}
    for _ in range(repeat):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            best[name] = min(best.get(name, float("inf")), time.perf_counter() - start)
    per_token = {name: 1e3 * t * MODEL_LAYERS / layers for name, t in best.items()}
    floor = per_token["K/V copy (floor)"]
    return {"context": context, "batch": batch, "layers_measured": layers, "ms_per_token": per_token,
            "over_copy": {name: t / floor for name, t in per_token.items()}}


def main() -> None:
    parser = harness.parser(__doc__, repeats=5, threads=os.cpu_count(), output=False)
    parser.add_argument("--cases", nargs="+", default=["4096x1", "4096x8", "16384x1", "16384x8"], help="CONTEXTxBATCH")
    parser.add_argument("--max-bytes", type=int, default=1 << 30)
    parser.add_argument("--kv-dtypes", nargs="*", default=[], choices=["bfloat16", "float16"],
                        help="also run the engine over a cache of these dtypes (the same values; float32 attention)")
    args = harness.parse_args(parser)
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    rows = []
    for case in args.cases:
        context, batch = (int(x) for x in case.split("x"))
        rows.append(run_case(context, batch, args.repeats, args.max_bytes, tuple(args.kv_dtypes)))
    print(json.dumps({"rows": rows, "threads": args.threads, "load_average": [load_before, os.getloadavg()],
                      "machine": f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}"}, indent=1))
    names = list(rows[0]["ms_per_token"])
    print("| context x batch | " + " | ".join(names) + " |")
    print("|---" * (len(names) + 1) + "|")
    for r in rows:
        cells = [f"{r['ms_per_token'][n]:.1f} ms ({r['over_copy'][n]:.2f}x)" for n in names]
        print(f"| {r['context']} x {r['batch']} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
