"""What prompt log-probabilities add to a prefill: the same prompt with and without prompt_logprobs, alternately.

    python benchmarks/engine/prompt_logprobs_overhead.py SmolLM2.gguf --tokens 8000 --nproc 1 --rounds 2

One engine (prefix cache off: every request prefills its whole prompt), one prompt of random token
ids; each round runs it with max_new_tokens=1 without prompt_logprobs and with prompt_logprobs=0
(the logprob of every prompt token), in turn first and second from round to round (since session 19:
before, "without" always ran first), and records each request's time to first token (the prefill)
and the CPU seconds this process and its rank processes spent on the request (Linux: /proc; on a
loaded machine the CPU time moves far less than the wall time, which waits for the cores).
Prints one JSON object: the times, the per-round ratios (with / without) of the wall and the CPU
times, their means and medians, the ratio of the mean times, and the load average read at the start and at the end.
"""

from __future__ import annotations

import json
import os
import statistics
import time

import torch

import treeattn as ta
from treeattn.bench import harness


def cpu_seconds() -> float:
    """User + system CPU seconds of this process and its descendants alive now (the engine's ranks), from /proc."""
    parents = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
        except OSError:  # gone meanwhile
            continue
        parents[int(pid)] = (int(fields[1]), int(fields[11]) + int(fields[12]))  # ppid, utime + stime (ticks)
    mine, grew = {os.getpid()}, True
    while grew:
        grew = False
        for pid, (ppid, _) in parents.items():
            if ppid in mine and pid not in mine:
                mine.add(pid)
                grew = True
    total = sum(parents[pid][1] for pid in mine if pid in parents)
    return total / os.sysconf("SC_CLK_TCK")


def main() -> None:
    parser = harness.parser(__doc__, model="required", nproc=1, output=False)
    parser.add_argument("--tokens", type=int, default=8000)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--prefill-chunk", type=int, default=512)
    args = harness.parse_args(parser)
    load_start = open("/proc/loadavg").read().split()[:3]
    from treeattn.models.loader import read_config

    prompt = torch.randint(100, read_config(args.model).vocab_size, (args.tokens,),
                           generator=torch.Generator().manual_seed(0)).tolist()
    rows = []
    with ta.Engine(args.model, nproc=args.nproc, prefix_cache=False, max_context=args.tokens + 8,
                   prefill_chunk=args.prefill_chunk) as engine:
        engine.generate([prompt[:64]], max_new_tokens=2)  # warm-up
        for _ in range(args.rounds):
            row = {}
            order = (("without", None), ("with", 0))
            for name, k in order if len(rows) % 2 == 0 else order[::-1]:  # ABBA: neither goes first every round
                start, cpu = time.perf_counter(), cpu_seconds()
                result = engine.generate([prompt], max_new_tokens=1, prompt_logprobs=k)[0]
                row[name] = result.ttft_s
                row[name + "_wall"] = time.perf_counter() - start
                row[name + "_cpu"] = cpu_seconds() - cpu
                if k is not None:
                    assert len(result.prompt_logprobs) == len(prompt)
            rows.append(row)
    ratios = [r["with"] / r["without"] for r in rows]
    cpu_ratios = [r["with_cpu"] / r["without_cpu"] for r in rows]
    print(json.dumps({"model": args.model, "tokens": args.tokens, "nproc": args.nproc, "prefill_chunk": args.prefill_chunk,
                      "rounds": rows, "ratios": ratios, "mean_ratio": sum(ratios) / len(ratios),
                      "median_ratio": statistics.median(ratios), "cpu_ratios": cpu_ratios,
                      "mean_cpu_ratio": sum(cpu_ratios) / len(cpu_ratios), "median_cpu_ratio": statistics.median(cpu_ratios),
                      "ratio_of_mean_times": sum(r["with"] for r in rows) / sum(r["without"] for r in rows),
                      "loadavg_start": load_start, "loadavg_end": open("/proc/loadavg").read().split()[:3]}, indent=1))


if __name__ == "__main__":
    main()
