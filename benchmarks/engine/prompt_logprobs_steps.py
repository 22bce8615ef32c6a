"""Where a prefill's extra time goes with prompt logprobs: per request and per step, alternately without and with.

    python3 benchmarks/engine/prompt_logprobs_steps.py SmolLM2.gguf --context 8000 --repeats 2

One rank in this process (nproc 1: the rank runs in the driver thread), prefix cache off, one prompt of random
token ids, max_new_tokens=1; each round runs it without prompt logprobs, then with prompt_logprobs=0. Per request:
the wall time, the process CPU seconds (every thread: torch's OpenMP workers and numba's too), the page faults
and context switches (getrusage), and, summed over the request's prefill steps, each step's wall and process CPU
seconds split into the scoring (PromptRows.compute and unpack) and the rest (the model's forward, the step's
own work), and each thread's CPU seconds (/proc/self/task: the driver thread that runs the rank, torch's OpenMP
worker, chunk_pool's threads, numba's). Inside the scoring, the calling thread's CPU seconds (time.thread_time: a
pool thread's own with 2+ torch threads, whose figures then add up over the threads) in the head's chunk products
(product_*), in the runs of chunks with their reductions (chunk_runs_*) and in whole blocks (blocks_*: also the
targets' product and the merge); outside it, on that clock, the model's forward (forward_*), its attention reads
(attend_*), the step's PagedBatch (batch_*) and the sampling (sampling_*).
--threads 1 runs the rank on one torch thread (no chunk_pool; on a loaded machine
OpenMP's waiting threads would spin for a core): set in this process before the engine starts, since with nproc 1
the rank runs in the driver thread and the engine's threads_per_rank sets only a spawned rank process's count.
Prints one JSON row a request; --output keeps them.
"""

from __future__ import annotations

import json
import resource
import time

import torch

import treeattn as ta
from treeattn.bench import harness
from treeattn.engine.worker import prompt_logprobs, runner


def usage() -> dict:
    """This process's CPU seconds (every thread), page faults and context switches so far."""
    u = resource.getrusage(resource.RUSAGE_SELF)
    return {"cpu_s": u.ru_utime + u.ru_stime, "minor_faults": u.ru_minflt, "major_faults": u.ru_majflt,
            "voluntary_switches": u.ru_nvcsw, "involuntary_switches": u.ru_nivcsw}


def main() -> None:
    parser = harness.parser(__doc__, model="required", context=8000, repeats=2)
    parser.add_argument("--prefill-chunk", type=int, default=512)
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads of the rank (default: the engine's; 1 on a loaded machine keeps OpenMP's "
                             "waiting threads from spinning for a core)")
    args = harness.parse_args(parser)
    from treeattn.models.loader import read_config

    totals = {}

    def timed(fn, name, clock=time.process_time):
        def wrapper(*a, **k):
            wall, cpu = time.perf_counter(), clock()
            try:
                return fn(*a, **k)
            finally:
                totals[name + "_wall_s"] = totals.get(name + "_wall_s", 0.0) + time.perf_counter() - wall
                totals[name + "_cpu_s"] = totals.get(name + "_cpu_s", 0.0) + clock() - cpu
        return wrapper

    runner.RankRunner.step = timed(runner.RankRunner.step, "steps")
    prompt_logprobs.PromptRows.compute = timed(prompt_logprobs.PromptRows.compute, "compute")
    prompt_logprobs.PromptRows.unpack = timed(prompt_logprobs.PromptRows.unpack, "unpack")
    # inside the scoring, thread CPU of the calling thread (a pool thread's own with 2+ torch threads): the head's
    # products (the chunks' and the targets'), each run of chunks (products and reductions), the blocks
    prompt_logprobs._Head.logits = timed(prompt_logprobs._Head.logits, "product", time.thread_time)
    prompt_logprobs._ChunkReducer.__call__ = timed(prompt_logprobs._ChunkReducer.__call__, "chunk_runs", time.thread_time)
    prompt_logprobs._score_block = timed(prompt_logprobs._score_block, "blocks", time.thread_time)
    # outside the scoring, the same clock: the model's forward (its modules: attention calls, MLPs), its attention
    # reads (PagedBatch.attend), building the step's batch, and rank 0's sampling of the chunks' last rows
    from treeattn.engine.worker import batch
    from treeattn.models import llama

    llama.LlamaModel.forward = timed(llama.LlamaModel.forward, "forward", time.thread_time)
    batch.PagedBatch.attend = timed(batch.PagedBatch.attend, "attend", time.thread_time)
    batch.PagedBatch.__init__ = timed(batch.PagedBatch.__init__, "batch", time.thread_time)
    runner.RankRunner._outcome = timed(runner.RankRunner._outcome, "sampling", time.thread_time)
    prompt = torch.randint(100, read_config(args.model).vocab_size, (args.context,),
                           generator=torch.Generator().manual_seed(0)).tolist()
    rows = []
    if args.threads:  # with nproc 1 the rank runs in the engine's driver thread, which starts with this count
        torch.set_num_threads(args.threads)  # (threads_per_rank sets only a spawned rank process's)
    with ta.Engine(args.model, nproc=1, prefix_cache=False, max_context=args.context + 8,
                   prefill_chunk=args.prefill_chunk, threads_per_rank=args.threads) as engine:
        engine.generate([prompt[:64]], max_new_tokens=2)  # warm-up
        for round_ in range(args.repeats):
            for name, k in (("without", None), ("with", 0)):
                totals.clear()
                threads, before, wall = harness.thread_cpu(), usage(), time.perf_counter()
                result = engine.generate([prompt], max_new_tokens=1, prompt_logprobs=k)[0]
                after, threads = usage(), harness.by_thread(threads, harness.thread_cpu())
                row = {"round": round_, "logprobs": name, "wall_s": time.perf_counter() - wall, "ttft_s": result.ttft_s,
                       **{key: after[key] - before[key] for key in after}, **totals,
                       "thread_cpu_s": threads, "loadavg": open("/proc/loadavg").read().split()[:3]}
                scoring = totals.get("compute_cpu_s", 0.0) + totals.get("unpack_cpu_s", 0.0)
                row["steps_less_scoring_cpu_s"] = row["steps_cpu_s"] - scoring
                rows.append(row)
                print(json.dumps(row), flush=True)
    harness.write_output(args.output, rows)


if __name__ == "__main__":
    main()
