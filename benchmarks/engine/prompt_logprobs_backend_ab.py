"""An 8K prefill with and without prompt logprobs under each float32-product rule, alternated in one engine.

    python3 benchmarks/engine/prompt_logprobs_backend_ab.py SmolLM2.gguf --context 8000 --repeats 3

One rank in this process (nproc 1: the rank runs in the driver thread), prefix cache off, one prompt of random token
ids, max_new_tokens=1. ops.dense_linear's rule (MKL_VENDORS) decides every float32 product of many rows: the
prefill's packed layers and the prompt rows' LM head. Each round runs five requests, their order rotated from round
to round:
- onednn_without / onednn_plain: oneDNN's matmul everywhere (session 19's rule on any host), no prompt logprobs / with
  them, the head multiplied as a plain float32 copy (dense_head);
- onednn_prepacked: the same rule, with prompt logprobs, the head prepacked by chunks (prepacked_head: what a
  non-Intel host runs since session 20);
- mkl_without / mkl_plain: MKL's sgemm everywhere (F.linear: what an Intel host runs since session 20), without and
  with prompt logprobs (the plain copy).
Per request: wall and TTFT seconds, the process CPU seconds (getrusage), the CPU and wall seconds inside
PromptRows.compute (the scoring). Then per round the ratios (each "with" over its rule's "without"; mkl over onednn
for the same request kind), their median and mean, and the largest logprob difference between the variants. Prints
one JSON row a request, then the summary; --output keeps all of it.
"""

from __future__ import annotations

import json
import resource
import statistics
import time

import torch

import treeattn as ta
from treeattn.bench import harness
from treeattn.engine.worker import prompt_logprobs
from treeattn.ops import dense_linear

VARIANTS = ("onednn_without", "onednn_plain", "onednn_prepacked", "mkl_without", "mkl_plain")
RATIOS = {"onednn_plain / onednn_without": ("onednn_plain", "onednn_without"),
          "onednn_prepacked / onednn_without": ("onednn_prepacked", "onednn_without"),
          "mkl_plain / mkl_without": ("mkl_plain", "mkl_without"),
          "mkl_without / onednn_without": ("mkl_without", "onednn_without"),
          "mkl_plain / onednn_plain": ("mkl_plain", "onednn_plain"),
          "onednn_prepacked / onednn_plain": ("onednn_prepacked", "onednn_plain"),
          "mkl_plain / onednn_prepacked": ("mkl_plain", "onednn_prepacked")}


def use(variant: str, prepacked_head) -> None:
    """Set ops.dense_linear's rule and prompt_logprobs' head for `variant`."""
    dense_linear.MKL_VENDORS = (dense_linear.cpu_vendor(),) if variant.startswith("mkl") else ()
    prompt_logprobs.prepacked_head = prepacked_head if variant == "onednn_prepacked" else (lambda model: None)


def summary(rows: list[dict]) -> dict:
    """Per ratio, each round's value (wall, ttft, process CPU), their median and mean."""
    out = {}
    for name, (top, bottom) in RATIOS.items():
        ratios = {"wall": [], "ttft": [], "cpu": []}
        for round_ in sorted({r["round"] for r in rows}):
            a = next(r for r in rows if r["round"] == round_ and r["variant"] == top)
            b = next(r for r in rows if r["round"] == round_ and r["variant"] == bottom)
            ratios["wall"].append(a["wall_s"] / b["wall_s"])
            ratios["ttft"].append(a["ttft_s"] / b["ttft_s"])
            ratios["cpu"].append(a["cpu_s"] / b["cpu_s"])
        out[name] = {k: {"rounds": [round(x, 4) for x in v], "median": round(statistics.median(v), 4),
                         "mean": round(statistics.mean(v), 4)} for k, v in ratios.items()}
    return out


def main() -> None:
    parser = harness.parser(__doc__, model="required", context=8000, repeats=3)
    parser.add_argument("--prefill-chunk", type=int, default=512)
    args = harness.parse_args(parser)
    from treeattn.models.loader import read_config

    spent = {}
    prepacked_head = prompt_logprobs.prepacked_head
    vendors = dense_linear.MKL_VENDORS
    prompt_logprobs.PromptRows.compute = harness.timed_calls(prompt_logprobs.PromptRows.compute, spent)
    prompt = torch.randint(100, read_config(args.model).vocab_size, (args.context,),
                           generator=torch.Generator().manual_seed(0)).tolist()
    rows, logprobs = [], {}
    load_start = open("/proc/loadavg").read().split()[:3]
    with ta.Engine(args.model, nproc=1, prefix_cache=False, max_context=args.context + 8,
                   prefill_chunk=args.prefill_chunk) as engine:
        for variant in VARIANTS:  # warm-up: the head's copy and its prepacked chunks made before any timed request
            use(variant, prepacked_head)
            engine.generate([prompt[:600]], max_new_tokens=1, prompt_logprobs=None if "without" in variant else 0)
        for round_ in range(args.repeats):
            shift = round_ % len(VARIANTS)
            for variant in VARIANTS[shift:] + VARIANTS[:shift]:
                use(variant, prepacked_head)
                spent.clear()
                cpu, wall = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
                result = engine.generate([prompt], max_new_tokens=1,
                                         prompt_logprobs=None if "without" in variant else 0)[0]
                after, wall = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter() - wall
                row = {"round": round_, "variant": variant, "wall_s": wall, "ttft_s": result.ttft_s,
                       "cpu_s": after.ru_utime + after.ru_stime - cpu.ru_utime - cpu.ru_stime,
                       "compute_cpu_s": spent.get("cpu", 0.0), "compute_wall_s": spent.get("wall", 0.0),
                       "loadavg": open("/proc/loadavg").read().split()[:3]}
                if "without" not in variant:
                    logprobs[variant] = [(e.logprob, e.rank) for e in result.prompt_logprobs[1:]]
                rows.append(row)
                print(json.dumps(row), flush=True)
        dense_linear.MKL_VENDORS, prompt_logprobs.prepacked_head = vendors, prepacked_head
    base = logprobs["onednn_plain"]
    differences = {name: {"max_logprob_difference": max(abs(a[0] - b[0]) for a, b in zip(base, lp)),
                          "ranks_differing": sum(a[1] != b[1] for a, b in zip(base, lp))}
                   for name, lp in logprobs.items() if name != "onednn_plain"}
    result = {"cpu": open("/proc/cpuinfo").read().split("model name")[1].split("\n")[0].strip(": "),
              "summary": summary(rows), "against_onednn_plain": differences, "rows": len(base),
              "loadavg_start": load_start, "loadavg_end": open("/proc/loadavg").read().split()[:3]}
    print(json.dumps(result, indent=1))
    harness.write_output(args.output, rows + [result])


if __name__ == "__main__":
    main()
