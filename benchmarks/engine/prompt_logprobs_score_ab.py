"""Prompt logprobs' scoring (treeattn.engine.worker.prompt_logprobs.score_rows) at a baseline commit against
this tree's, alternately, in CPU seconds of this process (all its threads: spin-waits count).

    python3 benchmarks/engine/prompt_logprobs_score_ab.py SmolLM2.gguf --baseline 12fbd32 --threads 1 2 --repeats 3

The baseline's module is read with `git show COMMIT:src/treeattn/engine/worker/prompt_logprobs.py` and loaded
beside this tree's; both score the same random hidden states (--context rows) on the model's own output
projection. Checks that the logprobs agree within 1e-5 and the ranks are equal; prints, per thread count, each
round's CPU and wall seconds and their ratios (this tree / baseline), and the load average.
"""

from __future__ import annotations

import json
import time

import torch

import treeattn.engine.worker.prompt_logprobs as current
from treeattn.bench import harness


def baseline_module(commit: str):
    """prompt_logprobs as it was at `commit` (harness.module_at)."""
    return harness.module_at(commit, "src/treeattn/engine/worker/prompt_logprobs.py", "prompt_logprobs_baseline")


def main() -> None:
    parser = harness.parser(__doc__, model="required", context=2048, threads=[1, 2], repeats=3)
    parser.add_argument("--baseline", default="12fbd32", help="the commit whose score_rows is the baseline")
    args = harness.parse_args(parser)
    from treeattn.models.loader import load_model

    model = load_model(args.model, weight_format="auto")
    old = baseline_module(args.baseline)
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(args.context, model.config.hidden_size, generator=g)
    targets = torch.randint(0, model.config.vocab_size, (args.context,), generator=g)
    a, b = old.score_rows(model, hidden, targets, 0), current.score_rows(model, hidden, targets, 0)
    assert (a[:, 0] - b[:, 0]).abs().max().item() < 1e-5 and torch.equal(a[:, 1], b[:, 1])
    rows = []
    for threads in args.threads:
        torch.set_num_threads(threads)
        for _ in range(args.repeats):
            row = {"threads": threads}
            for name, module in (("baseline", old), ("current", current)):
                start, wall = time.process_time(), time.perf_counter()
                module.score_rows(model, hidden, targets, 0)
                row[name + "_cpu_s"] = time.process_time() - start
                row[name + "_wall_s"] = time.perf_counter() - wall
            row["ratio"] = row["current_cpu_s"] / row["baseline_cpu_s"]
            row["wall_ratio"] = row["current_wall_s"] / row["baseline_wall_s"]
            row["loadavg"] = open("/proc/loadavg").read().split()[:3]
            rows.append(row)
            print(json.dumps(row), flush=True)
    harness.write_output(args.output, rows)
    print(json.dumps({"loadavg_end": open("/proc/loadavg").read().split()[:3]}))


if __name__ == "__main__":
    main()
