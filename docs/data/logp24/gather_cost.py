"""What a run gathered when its blocks are not adjacent costs (engine.worker.batch._runs, session 24), per layer.

    PYTHONPATH=src python3 docs/data/logp24/gather_cost.py [--repeats 9]

SmolLM2's attention shape (9 query heads, 3 KV heads, head dim 64), blocks of 256 keys, the last 512-query prompt
chunk of an 8,192-token prompt (positions 7680..8191) over its 32 blocks, one torch thread, thread CPU
(time.thread_time_ns), one layer's read as PagedBatch._local_runs makes it:

- "view": the 32 blocks adjacent, one attention call over a view of the arena (what both main and the branch do);
- "gathered": the blocks not adjacent (block 0 last, as a FIFO pool that wrapped hands them out), the branch: one
  cache.gather of the run, then the same call (the same bits as "view": checked);
- "two runs": the same layout, main: one call over blocks 1..31 (a view) and one over block 0, merge_states_list.

Alternated in rotated order; prints the medians, their ratios to "view", the bits' check, the load."""
import argparse, json, statistics, time
import torch
from treeattn.bench import harness
from treeattn.cache.paged import PagedKVCache
from treeattn.ops import attention, merge_states_list

p = argparse.ArgumentParser()
p.add_argument("--repeats", type=int, default=9)
args = p.parse_args()
torch.set_num_threads(1)
bs, nb, hq, hkv, d = 256, 32, 9, 3, 64
cache = PagedKVCache(num_layers=1, num_kv_heads=hkv, head_dim=d, num_blocks=nb + 1, block_size=bs)
g = torch.Generator().manual_seed(0)
cache.arena.normal_(generator=g)
q = torch.randn(1, 512, hq, d, generator=g)
q_pos = torch.arange(7680, 8192)[None]
kv_pos = torch.arange(nb * bs)[None]
ids = torch.tensor([list(range(1, nb)) + [0]])  # the wrapped layout: logical blocks 0..30 in 1..31, block 31 in 0


def contiguous():
    k, v = (x[None] for x in cache.run(0, 0, nb))
    return attention(q, k, v, causal=True, q_pos=q_pos, kv_pos=kv_pos)


def gathered():
    k, v = cache.gather(0, ids)
    return attention(q, k, v, causal=True, q_pos=q_pos, kv_pos=kv_pos)


def two_runs():
    k, v = (x[None] for x in cache.run(0, 1, nb - 1))
    k0, v0 = (x[None] for x in cache.run(0, 0, 1))
    a = attention(q, k, v, causal=True, q_pos=q_pos, kv_pos=kv_pos[:, : (nb - 1) * bs])
    b = attention(q, k0, v0, causal=True, q_pos=q_pos, kv_pos=kv_pos[:, (nb - 1) * bs :])
    return merge_states_list([a[0], b[0]], [a[1], b[1]])


# the bits: a gathered copy of the blocks in logical order equals a view of the same values laid out adjacently
k_log, v_log = cache.gather(0, ids)
arena_copy = cache.arena.clone()
cache.arena[0, :, :nb] = torch.stack([k_log[0].view(nb, bs, hkv, d), v_log[0].view(nb, bs, hkv, d)])  # adjacent from 0
same_bits = all(torch.equal(a, b) for a, b in zip(contiguous(), (attention(q, k_log, v_log, causal=True, q_pos=q_pos, kv_pos=kv_pos))))
cache.arena.copy_(arena_copy)
ways = {"view": contiguous, "gathered": gathered, "two runs": two_runs}
for fn in ways.values():
    fn()
times = {name: [] for name in ways}
load0 = open("/proc/loadavg").read().split()[:3]
names = list(ways)
for r in range(args.repeats):
    for name in names[r % 3:] + names[: r % 3]:
        t0 = time.thread_time_ns()
        ways[name]()
        times[name].append((time.thread_time_ns() - t0) / 1e9)
med = {k: statistics.median(v) for k, v in times.items()}
print(json.dumps({"same_bits_gathered_and_view": same_bits, "median_layer_thread_cpu_s": med,
                  "over_view": {k: v / med["view"] for k, v in med.items()}, "times": times,
                  "load_start": load0, "load_end": open("/proc/loadavg").read().split()[:3], "cpu": harness.cpu_model()}, indent=1))
