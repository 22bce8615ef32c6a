"""Does the head's product slow down when the caches were flushed between blocks, as the engine's forward does?

    PYTHONPATH=src python3 docs/data/logp24/cold_cache_ab.py [--repeats 6]

One torch thread, thread CPU (time.thread_time_ns) of one 512-row block as score_rows runs it (24 chunks of 2048
columns: product, then reduce_chunk), SmolLM2's head (_Head.of), random hidden rows; "warm": blocks back to back,
"cold": 512 MiB written (not timed) before each block. Alternated (ABAB). Prints the medians and their ratio."""
import argparse, json, statistics, time
import numpy as np
import torch
from treeattn.bench import harness
from treeattn.engine.worker import prompt_logprobs as pl
from treeattn.models import load_model
from treeattn.ops import logits_cpu_kernel as kern

p = argparse.ArgumentParser()
p.add_argument("--repeats", type=int, default=6)
args = p.parse_args()
torch.set_num_threads(1)
torch.set_grad_enabled(False)
W = pl._Head.of(load_model(harness.default_model())).weight
V, cols = W.shape[0], 2048
g = torch.Generator().manual_seed(0)
hidden, target = torch.randn(512, W.shape[1], generator=g), torch.randn(512, generator=g)
maxes, sums, larger = (np.empty(512, dtype=np.float32) for _ in range(3))
vals, ids = np.full((512, 0), -np.inf, dtype=np.float32), np.zeros((512, 0), dtype=np.int64)
junk = torch.empty(512 << 18)  # 512 MiB of float32

def block():
    for j in range(0, V, cols):
        logits = torch.nn.functional.linear(hidden, W[j:j + cols])
        kern.reduce_chunk(logits.numpy(), target.numpy(), j, maxes, sums, larger, vals, ids)

block()
times = {"warm": [], "cold": []}
load0 = open("/proc/loadavg").read().split()[:3]
for r in range(args.repeats):
    for name in ("warm", "cold") if r % 2 == 0 else ("cold", "warm"):
        if name == "cold":
            junk.fill_(r)
        else:
            block()  # the warm block runs right after a block
        t0 = time.thread_time_ns()
        block()
        times[name].append((time.thread_time_ns() - t0) / 1e9)
med = {k: statistics.median(v) for k, v in times.items()}
print(json.dumps({"median_block_thread_cpu_s": med, "cold_over_warm": med["cold"] / med["warm"], "times": times,
                  "load_start": load0, "load_end": open("/proc/loadavg").read().split()[:3], "cpu": harness.cpu_model()}, indent=1))
