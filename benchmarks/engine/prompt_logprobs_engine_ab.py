"""Prompt logprobs in one engine's prefill with a baseline commit's scoring and this tree's, alternately.

    python3 benchmarks/engine/prompt_logprobs_engine_ab.py SmolLM2.gguf --baseline 3c78e02 --context 8000 --repeats 2

One rank in this process (nproc 1: the rank runs in the driver thread, so the scoring it calls can be swapped
between requests), prefix cache off, one prompt of random token ids. Each round runs it with max_new_tokens=1
without prompt logprobs, with prompt_logprobs=0 scored by the baseline's
treeattn.engine.worker.prompt_logprobs.score_rows (read with `git show COMMIT:...`, loaded beside this tree's), and
with this tree's, in that order in even rounds and the reverse in odd ones (since session 23). Per request: the
process CPU seconds (all threads: on a loaded machine the wall time is the wait for a core, the CPU time far less
so), the CPU seconds inside score_rows, the wall time and the time to first token (the prefill). Per round the
largest logprob difference and the number of ranks that differ between the two scorings (a row of its own); fails at
the end unless every round's are under 1e-4 and 0 (two prefills of one 8K prompt in one engine differed by 1.2e-5
whatever scored them: docs/engine.md, "Session 23 (logp23)"). Prints one JSON row a request; --output keeps them.
"""

from __future__ import annotations

import json
import time

import torch

import treeattn as ta
import treeattn.engine.worker.prompt_logprobs as current
from treeattn.bench import harness


def baseline_module(commit: str):
    """prompt_logprobs as it was at `commit` (harness.module_at)."""
    return harness.module_at(commit, "src/treeattn/engine/worker/prompt_logprobs.py", "prompt_logprobs_baseline")


def main() -> None:
    parser = harness.parser(__doc__, model="required", context=8000, repeats=2)
    parser.add_argument("--baseline", default="3c78e02", help="the commit whose score_rows is the baseline")
    parser.add_argument("--prefill-chunk", type=int, default=512)
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads of the rank (default: the engine's; 1 on a loaded machine keeps OpenMP's "
                             "waiting threads from spinning for a core)")
    args = harness.parse_args(parser)
    from treeattn.models.loader import read_config

    scorers = {"baseline": baseline_module(args.baseline).score_rows, "current": current.score_rows}
    spent = [0.0]

    def timed(score):
        def score_rows(*a, **k):
            start = time.process_time()
            try:
                return score(*a, **k)
            finally:
                spent[0] += time.process_time() - start
        return score_rows

    prompt = torch.randint(100, read_config(args.model).vocab_size, (args.context,),
                           generator=torch.Generator().manual_seed(0)).tolist()
    rows, logprobs = [], {}
    if args.threads:  # with nproc 1 the rank runs in the engine's driver thread, which starts with this count
        torch.set_num_threads(args.threads)  # (threads_per_rank sets only a spawned rank process's: before session 24
        # this script passed only that, so its "--threads 1" runs ran on the default 2 threads)
    with ta.Engine(args.model, nproc=1, prefix_cache=False, max_context=args.context + 8,
                   prefill_chunk=args.prefill_chunk, threads_per_rank=args.threads) as engine:
        engine.generate([prompt[:64]], max_new_tokens=2)  # warm-up
        for round_ in range(args.repeats):
            order = ("without", "baseline", "current")
            for name in order if round_ % 2 == 0 else order[::-1]:  # ABBA: neither scoring always runs first
                current.score_rows = timed(scorers.get(name, current.score_rows))  # PromptRows.compute calls it
                spent[0], start, cpu = 0.0, time.perf_counter(), time.process_time()
                result = engine.generate([prompt], max_new_tokens=1, prompt_logprobs=None if name == "without" else 0)[0]
                row = {"round": round_, "scoring": name, "cpu_s": time.process_time() - cpu, "ttft_s": result.ttft_s,
                       "score_rows_cpu_s": spent[0], "wall_s": time.perf_counter() - start,
                       "loadavg": open("/proc/loadavg").read().split()[:3]}
                if name != "without":
                    logprobs[name] = [(e.logprob, e.rank) for e in result.prompt_logprobs[1:]]
                rows.append(row)
                print(json.dumps(row), flush=True)
            current.score_rows = scorers["current"]
            pairs = list(zip(logprobs["baseline"], logprobs["current"]))
            agreement = {"round": round_, "max_logprob_difference": max(abs(a[0] - b[0]) for a, b in pairs),
                         "rank_differences": sum(a[1] != b[1] for a, b in pairs)}
            rows.append(agreement)
            print(json.dumps(agreement), flush=True)
    harness.write_output(args.output, rows)
    assert all(r.get("max_logprob_difference", 0) < 1e-4 and r.get("rank_differences", 0) == 0 for r in rows), \
        "the scorings disagree"


if __name__ == "__main__":
    main()
