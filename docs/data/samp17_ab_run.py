"""One arm of samp17's A/B: decode CPU time per token of each process (this one and its rank children, /proc
utime + stime: every thread of each), Gemma 3 270M (or MODEL) greedy on an Engine without logprobs (the greedy
fast path's case), CONTEXT tokens of a synthetic prompt, float16 KV, packed weights, int8 activations.
Usage: python docs/data/samp17_ab_run.py MODEL CONTEXT NPROC TOKENS LABEL   (PYTHONPATH picks the arm's src)"""
import json
import os
import sys
import time

import torch

import treeattn
from treeattn.engine.client import Engine
from treeattn.models.synthetic import synthetic_prompt


def cpu_of(pid: int) -> float:
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def descendants(pid: int) -> list[int]:
    out = []
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            children = [int(p) for p in open(f"/proc/{pid}/task/{task}/children").read().split()]
        except OSError:
            continue
        for child in children:
            out += [child] + descendants(child)
    return out


def main() -> None:
    path, ctx, nproc, n, label = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
    torch.set_num_threads(1)

    def snapshot():
        return {p: cpu_of(p) for p in [os.getpid()] + descendants(os.getpid())}

    kw = dict(nproc=nproc, max_batch_size=1, prefix_cache=True, block_size=256, cache_tokens=2 * (ctx + n + 8) + 512 * nproc,
              max_context=ctx + n + 8, kv_cache_dtype="float16", weight_format="packed", activation_format="int8")
    prompt = synthetic_prompt(ctx, 262144 if "gemma" in path else 49152, 0)
    with Engine(path, **kw) as engine:
        engine.generate([prompt], max_new_tokens=2, ignore_eos=True)  # the prompt into the prefix cache
        a, w0 = snapshot(), time.perf_counter()
        engine.generate([prompt], max_new_tokens=2, ignore_eos=True)  # prefill from the cache + 1 decode step
        b, w1 = snapshot(), time.perf_counter()
        result, = engine.generate([prompt], max_new_tokens=n + 2, ignore_eos=True)  # the same + n decode steps
        c, w2 = snapshot(), time.perf_counter()
    per = [round(1e3 * ((c[p] - b[p]) - (b[p] - a[p])) / n, 2) for p in c if p in a and p in b]
    print(json.dumps({"label": label, "src": os.path.dirname(treeattn.__file__), "nproc": nproc, "ctx": ctx, "tokens_timed": n,
                      "cpu_ms_per_token_by_process": per, "wall_ms_per_token": round(1e3 * ((w2 - w1) - (w1 - w0)) / n, 2),
                      "tokens": result.token_ids, "loadavg": open("/proc/loadavg").read().split()[:3]}), flush=True)


if __name__ == "__main__":
    main()
