"""An 8K prefill without prompt logprobs, with them by MKL's LM head product, and by oneDNN's, alternated in one engine.

    python3 benchmarks/engine/prompt_logprobs_product_ab.py SmolLM2.gguf --context 8000 --repeats 4

One rank in this process (nproc 1: the rank runs in the driver thread), prefix cache off, one prompt of random token
ids, max_new_tokens=1. Each round runs it without prompt logprobs, then with prompt_logprobs=0 twice: the LM head's
float32 product by F.linear (MKL's sgemm, what model.logits(weight=...) called before session 19) and by
ops.dense_linear.linear_float32 (oneDNN's matmul, now), in alternating order from round to round. Per request: the
time to first token and the wall time, the process CPU seconds (getrusage: every thread), the CPU and wall seconds
inside PromptRows.compute (the scoring), and each thread's CPU seconds (/proc/self/task). Then per variant every
round's ratio to the same round's request without logprobs (wall, TTFT and CPU), their median and mean, and the
largest logprob difference and the number of ranks that differ between the two products. Prints one JSON row a
request, then the summary; --output keeps all of it.
"""

from __future__ import annotations

import json
import resource
import statistics
import time

import torch
import torch.nn.functional as F

import treeattn as ta
import treeattn.models.llama as llama
from treeattn.bench import harness
from treeattn.engine.worker import prompt_logprobs
from treeattn.ops.dense_linear import linear_float32

PRODUCTS = {"mkl": F.linear, "onednn": linear_float32}


def summary(rows: list[dict]) -> dict:
    """Per variant, each round's with / without ratios (wall, ttft, process CPU), their median and mean."""
    out = {}
    for variant in PRODUCTS:
        ratios = {"wall": [], "ttft": [], "cpu": [], "scoring_cpu_s": []}
        for round_ in sorted({r["round"] for r in rows}):
            base = next(r for r in rows if r["round"] == round_ and r["variant"] == "without")
            row = next(r for r in rows if r["round"] == round_ and r["variant"] == variant)
            ratios["wall"].append(row["wall_s"] / base["wall_s"])
            ratios["ttft"].append(row["ttft_s"] / base["ttft_s"])
            ratios["cpu"].append(row["cpu_s"] / base["cpu_s"])
            ratios["scoring_cpu_s"].append(row["compute_cpu_s"])
        out[variant] = {k: {"rounds": [round(x, 4) for x in v], "median": round(statistics.median(v), 4),
                            "mean": round(statistics.mean(v), 4)} for k, v in ratios.items()}
    return out


def main() -> None:
    parser = harness.parser(__doc__, model="required", context=8000, repeats=4)
    parser.add_argument("--prefill-chunk", type=int, default=512)
    args = harness.parse_args(parser)
    from treeattn.models.loader import read_config

    spent = {}
    prompt_logprobs.PromptRows.compute = harness.timed_calls(prompt_logprobs.PromptRows.compute, spent)
    prompt = torch.randint(100, read_config(args.model).vocab_size, (args.context,),
                           generator=torch.Generator().manual_seed(0)).tolist()
    rows, logprobs = [], {}
    load_start = open("/proc/loadavg").read().split()[:3]
    with ta.Engine(args.model, nproc=1, prefix_cache=False, max_context=args.context + 8,
                   prefill_chunk=args.prefill_chunk) as engine:
        engine.generate([prompt[:64]], max_new_tokens=2, prompt_logprobs=0)  # warm-up (the head's float32 copy made)
        for round_ in range(args.repeats):
            order = ["without", "mkl", "onednn"] if round_ % 2 == 0 else ["without", "onednn", "mkl"]
            for variant in order:
                llama.linear_float32 = PRODUCTS.get(variant, linear_float32)  # what LlamaModel.logits(weight=...) calls
                spent.clear()
                threads, cpu, wall = harness.thread_cpu(), resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
                result = engine.generate([prompt], max_new_tokens=1, prompt_logprobs=None if variant == "without" else 0)[0]
                after, wall = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter() - wall
                row = {"round": round_, "variant": variant, "wall_s": wall, "ttft_s": result.ttft_s,
                       "cpu_s": after.ru_utime + after.ru_stime - cpu.ru_utime - cpu.ru_stime,
                       "compute_cpu_s": spent.get("cpu", 0.0), "compute_wall_s": spent.get("wall", 0.0),
                       "minor_faults": after.ru_minflt - cpu.ru_minflt,
                       "thread_cpu_s": harness.by_thread(threads, harness.thread_cpu()),
                       "loadavg": open("/proc/loadavg").read().split()[:3]}
                if variant != "without":
                    logprobs[variant] = [(e.logprob, e.rank) for e in result.prompt_logprobs[1:]]
                rows.append(row)
                print(json.dumps(row), flush=True)
            llama.linear_float32 = linear_float32
    pairs = list(zip(logprobs["mkl"], logprobs["onednn"]))
    result = {"summary": summary(rows), "max_logprob_difference": max(abs(a[0] - b[0]) for a, b in pairs),
              "ranks_differing": sum(a[1] != b[1] for a, b in pairs), "rows": len(pairs),
              "loadavg_start": load_start, "loadavg_end": open("/proc/loadavg").read().split()[:3]}
    print(json.dumps(result, indent=1))
    harness.write_output(args.output, rows + [result])


if __name__ == "__main__":
    main()
