"""TTFT over a working set of documents larger than the arena, with and without the disk store (docs/kv_store.md).

    flock /tmp/treeattn-bench.lock python benchmarks/serving/kv_store_working_set.py --docs 8 --context 512 --arena-docs 2

--docs documents of random token ids each (--context tokens, seed 0), an arena of --arena-docs documents'
blocks (cache_tokens; the working set is docs / arena-docs times the arena), and --requests requests
in one seeded random order, each a document followed by a 16-token question, one at a time,
greedy, one new token (the time to first token is the measure), after one warm-up request each. The same requests run twice in
one process, alternating the settings by request: engine A with no second tier, engine B with
--kv-store on a fresh directory bounded by --store-bytes (default: 1.25 x the working set's
bytes). Reported: TTFT p50, p90, p99 and max per setting (p99 of a few dozen requests is
about the max), the store's counters, and the load average before and after. SmolLM2 (Q4_1 GGUF)
unless MODEL (a GGUF or HF directory, or "demo": a random 2-layer model, to check the script).
"""

from __future__ import annotations

import json
import os
import platform
import random
import statistics
import tempfile

from treeattn.bench import harness


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))]


def main() -> None:
    parser = harness.parser(__doc__, model="smollm2", context=512, nproc=1, output=False,
                            helps={"context": "tokens per document"})
    parser.add_argument("--docs", type=int, default=8)
    parser.add_argument("--arena-docs", type=int, default=2)
    parser.add_argument("--requests", type=int, default=24)
    parser.add_argument("--block-size", type=int, default=256)
    parser.add_argument("--store-bytes", type=int, default=None)
    args = harness.parse_args(parser)
    import treeattn as ta
    model = args.model
    if model == "demo":  # the demo's random model (treeattn.eval.synthetic.DEMO_CONFIG): a quick check of this script
        from treeattn.eval.synthetic import DEMO_CONFIG
        from treeattn.models.llama import LlamaConfig, random_model

        model = random_model(LlamaConfig(**DEMO_CONFIG), seed=0)
    rng = random.Random(0)
    vocab = 4096 if not isinstance(model, str) else 40000
    docs = [[rng.randrange(100, vocab) for _ in range(args.context)] for _ in range(args.docs)]
    order = [rng.randrange(args.docs) for _ in range(args.requests)]
    prompts = [docs[d] + [rng.randrange(100, vocab) for _ in range(16)] for d in order]
    cache_tokens = args.arena_docs * args.context + 2 * args.block_size  # the documents, a question block, slack
    common = dict(nproc=args.nproc, block_size=args.block_size, cache_tokens=cache_tokens, max_batch_size=1)
    print(f"# {platform.machine()}, {os.cpu_count()} cores, {os.path.basename(model) if isinstance(model, str) else 'demo'}, "
          f"{args.docs} docs x {args.context} "
          f"tokens, arena {cache_tokens} tokens ({args.arena_docs} docs), {args.requests} requests, {args.nproc} rank(s), "
          f"load average {os.getloadavg()}", flush=True)
    with tempfile.TemporaryDirectory(prefix="kv-ws-") as store:
        with ta.Engine(model, **common) as plain:
            per_token = plain.rank_measurements()[0].kv_bytes / ((plain.pool.blocks_per_rank + 1) * args.block_size)
            bound = args.store_bytes or int(1.25 * per_token * args.docs * args.context)
            with ta.Engine(model, kv_store=store, kv_store_bytes=bound, **common) as tiered:
                for engine in (plain, tiered):  # warm-up (kernels compiled on first use): a prompt of no document
                    engine.generate([7] * 40, max_new_tokens=1, ignore_eos=True)
                ttft = {"arena only": [], "arena + disk store": []}
                for i, prompt in enumerate(prompts):
                    for name, engine in (("arena only", plain), ("arena + disk store", tiered))[:: 1 if i % 2 else -1]:
                        ttft[name].append(engine.generate(prompt, max_new_tokens=1, ignore_eos=True)[0].ttft_s)
                stats = {k: v for k, v in tiered.stats().items() if k.startswith(("store_", "arena_"))}
    for name, xs in ttft.items():
        print(json.dumps({"setting": name, "p50_s": round(statistics.median(xs), 3), "p90_s": round(percentile(xs, 0.9), 3),
                          "p99_s": round(percentile(xs, 0.99), 3), "max_s": round(max(xs), 3),
                          "mean_s": round(statistics.mean(xs), 3),
                          "ttft_s": [round(x, 3) for x in xs]}), flush=True)
    print(json.dumps({"store_bytes_bound": bound, "kv_bytes_per_token": per_token, "store": stats}))
    print(f"# load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
