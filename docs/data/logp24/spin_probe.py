"""Does the thread that hands a block's chunks to chunk_pool leave an OpenMP worker spinning beside the pool?

    PYTHONPATH=src python3 docs/data/logp24/spin_probe.py [--repeats 8]

As in a 2-thread, 1-rank engine step with prompt logprobs: the calling thread runs a parallel torch op on its 2
threads (the forward's last op, here a 512 x 576 x 1536 product), then one block's 24 chunk products of SmolLM2's
head are split over chunk_pool(2)'s two threads (12 each, one torch thread each) while it waits. Per repeat: the CPU
seconds that every thread of this process gains during the pool's work (/proc/self/task): the pool threads', the
caller's, and the others' (the caller's libgomp worker, which spins GOMP_SPINCOUNT times after a region before it
sleeps). "plain" as the engine does it; "released": ops.openmp.release_thread_pool() in the caller first (its worker
freed; the next parallel op starts a new one, whose start is timed too). Alternated (ABAB)."""
import argparse, json, statistics, time
import torch
from treeattn.bench import harness
from treeattn.engine.worker import prompt_logprobs as pl
from treeattn.models import load_model
from treeattn.ops.openmp import release_thread_pool

p = argparse.ArgumentParser()
p.add_argument("--repeats", type=int, default=8)
args = p.parse_args()
torch.set_grad_enabled(False)
torch.set_num_threads(2)
W = pl._Head.of(load_model(harness.default_model())).weight
g = torch.Generator().manual_seed(0)
hidden = torch.randn(512, W.shape[1], generator=g)
a, b = torch.randn(512, 576, generator=g), torch.randn(1536, 576, generator=g)
pool = pl.chunk_pool(2)
pool_ids = set()
pool_ids.update(pool.map(lambda _: __import__("threading").get_native_id(), range(2)))
import threading
me = threading.get_native_id()


def half(lo):
    for j in range(lo, lo + 12):
        torch.nn.functional.linear(hidden, W[j * 2048 : (j + 1) * 2048])
    return threading.get_native_id()


def one(release):
    torch.nn.functional.linear(a, b)  # the caller's parallel region (2 threads)
    start_release = time.perf_counter()
    if release:
        release_thread_pool()
    released_s = time.perf_counter() - start_release
    before, wall = harness.thread_cpu(), time.perf_counter()
    ids = set(pool.map(half, (0, 12)))
    wall = time.perf_counter() - wall
    after = harness.thread_cpu()
    gained = {tid: after[tid][1] - before.get(tid, (None, 0.0))[1] for tid in after}
    t0 = time.perf_counter()
    torch.nn.functional.linear(a, b)  # the next parallel op (a new worker after a release)
    next_op_s = time.perf_counter() - t0
    return {"pool_cpu_s": sum(v for t, v in gained.items() if t in ids), "caller_cpu_s": gained.get(me, 0.0),
            "others_cpu_s": sum(v for t, v in gained.items() if t not in ids and t != me), "pool_wall_s": wall,
            "release_s": released_s, "next_op_s": next_op_s}


one(False), one(True)
rows = {"plain": [], "released": []}
load0 = open("/proc/loadavg").read().split()[:3]
for r in range(args.repeats):
    for name in ("plain", "released") if r % 2 == 0 else ("released", "plain"):
        rows[name].append(one(name == "released"))
medians = {name: {k: statistics.median(x[k] for x in v) for k in v[0]} for name, v in rows.items()}
print(json.dumps({"medians": medians, "rows": rows, "load_start": load0, "load_end": open("/proc/loadavg").read().split()[:3],
                  "cpu": harness.cpu_model(), "note": "thread CPU from /proc in clock ticks (10 ms)"}, indent=1))
