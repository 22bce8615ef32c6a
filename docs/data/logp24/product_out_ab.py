"""A/B of the head's chunk product as score_rows runs it: F.linear (a fresh 4 MiB logits tensor a chunk) against
torch.mm into one reused buffer, each followed by the compiled reduction (reduce_chunk), one torch thread, thread CPU.

    PYTHONPATH=src python3 docs/data/logp24/product_out_ab.py [--blocks 4] [--repeats 4]

SmolLM2's head as score_rows multiplies it (_Head.of: its float32 tied embedding), 512 random hidden rows (std 1) a block, 24 chunks of
2048 columns; A and B alternated block by block (ABAB...); prints medians per block and the bits' check."""
import argparse, json, resource, statistics, time
import torch
import numpy as np
from treeattn.engine.worker import prompt_logprobs as pl
from treeattn.models import load_model
from treeattn.ops import logits_cpu_kernel as kern
from treeattn.bench import harness

p = argparse.ArgumentParser()
p.add_argument("--blocks", type=int, default=4)
p.add_argument("--repeats", type=int, default=4)
args = p.parse_args()
torch.set_num_threads(1)
torch.set_grad_enabled(False)
model = load_model(harness.default_model())
W = pl._Head.of(model).weight  # what score_rows multiplies (SmolLM2: its float32 embedding, tied)
V, cols = W.shape[0], 2048
g = torch.Generator().manual_seed(0)
hidden = torch.randn(512, W.shape[1], generator=g)
target = torch.randn(512, generator=g)
buf = torch.empty(512, cols)
maxes, sums, larger = (np.empty(512, dtype=np.float32) for _ in range(3))
vals, ids = np.full((512, 0), -np.inf, dtype=np.float32), np.zeros((512, 0), dtype=np.int64)

def fresh():
    for j in range(0, V, cols):
        logits = torch.nn.functional.linear(hidden, W[j:j + cols])
        kern.reduce_chunk(logits.numpy(), target.numpy(), j, maxes, sums, larger, vals, ids)

def reused():
    for j in range(0, V, cols):
        logits = torch.mm(hidden, W[j:j + cols].t(), out=buf)
        kern.reduce_chunk(logits.numpy(), target.numpy(), j, maxes, sums, larger, vals, ids)

same = all(torch.equal(torch.nn.functional.linear(hidden, W[j:j + cols]), torch.mm(hidden, W[j:j + cols].t(), out=buf))
           for j in range(0, V, cols))
fresh(); reused()
times = {"fresh": [], "reused": []}
faults = {"fresh": [], "reused": []}
load0 = open("/proc/loadavg").read().split()[:3]
for r in range(args.repeats * args.blocks):
    for name, fn in ((("fresh", fresh), ("reused", reused)) if r % 2 == 0 else (("reused", reused), ("fresh", fresh))):
        f0, t0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.thread_time_ns()
        fn()
        times[name].append((time.thread_time_ns() - t0) / 1e9)
        faults[name].append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
med = {k: statistics.median(v) for k, v in times.items()}
print(json.dumps({"bits_equal": same, "median_block_thread_cpu_s": med, "ratio_reused_to_fresh": med["reused"] / med["fresh"],
                  "median_minor_faults_a_block": {k: statistics.median(v) for k, v in faults.items()},
                  "times": times, "load_start": load0, "load_end": open("/proc/loadavg").read().split()[:3],
                  "cpu": harness.cpu_model()}, indent=1))
