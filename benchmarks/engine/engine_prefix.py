"""Prefix reuse in ta.Engine: two questions over the same long document (docs/benchmarks.md).

    flock /tmp/treeattn-bench.lock python benchmarks/engine/engine_prefix.py --context 16384 --nproc 2

The demo model (treeattn.eval.synthetic.DEMO_CONFIG: random weights, 2 layers, hidden 128, float32) on
--nproc gloo ranks, tree decoding, interleaved placement, blocks of 256 tokens. Request 1 is the
document + question 1 (a full prefill); request 2 is the document + question 2, sent after the
first finished: its prompt's full blocks come from the prefix cache. Reported: each request's time
to first token and cached prompt tokens, and the ratio of the TTFTs.
"""

from __future__ import annotations

import json
import os
import platform

import torch

import treeattn as ta
from treeattn.bench import harness
from treeattn.eval.synthetic import DEMO_CONFIG
from treeattn.models.llama import LlamaConfig, random_model


def main() -> None:
    parser = harness.parser(__doc__, context=16384, nproc=2, output=False,
                            helps={'context': "prompt length in tokens: the document's, as `treeattn demo --context`"})
    parser.add_argument("--question-tokens", type=int, default=16)
    parser.add_argument("--prefill-chunk", type=int, default=4096)
    args = harness.parse_args(parser)
    config = LlamaConfig(**DEMO_CONFIG)
    g = torch.Generator().manual_seed(0)
    doc = torch.randint(0, config.vocab_size, (args.context,), generator=g).tolist()
    questions = [torch.randint(0, config.vocab_size, (args.question_tokens,), generator=g).tolist() for _ in range(2)]
    with ta.Engine(random_model(config, seed=0), nproc=args.nproc, decode="tree", placement="interleaved", block_size=256,
                   cache_tokens=2 * args.context, prefill_chunk=args.prefill_chunk, threads_per_rank=1) as engine:
        first, second = (engine.generate([doc + q], max_new_tokens=4, ignore_eos=True)[0] for q in questions)
    print(json.dumps({
        "doc_tokens": args.context, "nproc": args.nproc,
        "first": {"ttft_s": first.ttft_s, "cached_prompt_tokens": first.cached_prompt_tokens},
        "second": {"ttft_s": second.ttft_s, "cached_prompt_tokens": second.cached_prompt_tokens},
        "ttft_ratio": first.ttft_s / second.ttft_s,
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}",
    }, indent=2))


if __name__ == "__main__":
    main()
