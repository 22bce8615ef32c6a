"""Time to first token after a restart with --kv-store, against the fresh prefill (docs/kv_store.md).

    flock /tmp/treeattn-bench.lock python benchmarks/serving/kv_store_restart.py --context 8192 --nproc 2 --kv-cache-dtype
    float32 bfloat16

For one needle-in-a-haystack prompt of about --context tokens (treeattn.eval.haystack, through the
model's chat template), for each --kv-cache-dtype, on an empty store directory: engine 1 (a fresh
prefill, its blocks written through to the store), closed; engine 2 on the same directory (a
restart): its prompt's full blocks load from disk and only the last partial block is prefilled.
Reported per dtype: both TTFTs and their ratio, the seconds the driver waited on the store's saves
(the write-through's cost, inside engine 1's TTFT) and loads, the bytes on disk per stored token
against the arena's bytes per token, the cached prompt tokens, whether the greedy tokens are
equal, and the load average before and after each engine. The model is SmolLM2-135M-Instruct
(treeattn.eval.demo.smollm2_path) unless MODEL names another.
"""

from __future__ import annotations

import json
import os
import platform
import tempfile
import time

from treeattn.bench import harness


def run(model: str, ids: list[int], args, kv: str, store: str) -> dict:
    import treeattn as ta

    load = os.getloadavg()[0]
    start = time.perf_counter()
    with ta.Engine(model, nproc=args.nproc, kv_cache_dtype=kv, kv_store=store, block_size=args.block_size) as engine:
        ready = time.perf_counter() - start
        result = engine.generate(ids, max_new_tokens=args.max_new_tokens, ignore_eos=True)[0]
        stats = engine.stats()
        kv_bytes = engine.rank_measurements()[0].kv_bytes
        blocks = engine.pool.blocks_per_rank + 1  # the arena's blocks and its padding block
    return {"ttft_s": round(result.ttft_s, 3), "engine_start_s": round(ready, 2),
            "cached_prompt_tokens": result.cached_prompt_tokens,
            "tokens": result.token_ids, "store": {k: (round(v, 4) if isinstance(v, float) else v) for k, v in stats.items()
                                                  if k.startswith(("store_", "arena_"))},
            "arena_bytes_per_token": kv_bytes / (blocks * args.block_size), "load_before_after": [round(load, 2),
                                                                                                  round(os.getloadavg()[0], 2)]}


def main() -> None:
    parser = harness.parser(__doc__, model="smollm2", context=8192, nproc=2,
                            kv_cache_dtype=["float32", "bfloat16"], max_new_tokens=8, output=False)
    parser.add_argument("--block-size", type=int, default=256)
    args = harness.parse_args(parser)
    from treeattn.eval.haystack import needle_case
    from treeattn.models.loader import read_model_files

    model = args.model
    files = read_model_files(model)
    case = needle_case(files.tokenizer, files.chat_template, context_tokens=args.context, depth=0.5, seed=0)
    ids = list(case.prompt_ids)
    print(f"# {platform.machine()}, {os.cpu_count()} cores, {os.path.basename(model)}, prompt {len(ids)} tokens, "
          f"{args.nproc} rank(s), blocks of {args.block_size}, load average {os.getloadavg()}", flush=True)
    for kv in args.kv_cache_dtype:
        with tempfile.TemporaryDirectory(prefix="kv-store-") as store:
            fresh = run(model, ids, args, kv, store)
            restart = run(model, ids, args, kv, store)
        saved = fresh["store"]["store_saved_bytes"]
        stored_tokens = (len(ids) // args.block_size) * args.block_size
        print(json.dumps({
            "kv_cache_dtype": kv, "fresh_ttft_s": fresh["ttft_s"], "restart_ttft_s": restart["ttft_s"],
            "restart_over_fresh": round(restart["ttft_s"] / fresh["ttft_s"], 4),
            "write_through_s": fresh["store"]["store_save_s"], "load_s": restart["store"]["store_load_s"],
            "disk_bytes_per_token": saved / stored_tokens, "arena_bytes_per_token": fresh["arena_bytes_per_token"],
            "restart_cached_prompt_tokens": restart["cached_prompt_tokens"], "tokens_equal": fresh["tokens"] == restart["tokens"],
            "fresh": fresh, "restart": restart}), flush=True)
    print(f"# load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
