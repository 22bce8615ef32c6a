"""samp17 micro A/B, UNDER LOAD: thread CPU time (time.thread_time) per decode row on each of 2 gloo ranks of the
step's sampling end with Gemma 3's vocabulary (262,144) split in 2 shares, through the shared-memory group the runner
uses (sized as RankRunner._groups sizes it): "full" = today's path (all-gather of the float32 shares, rank 0
concatenates, all_finite, greedy sample()), "fast" = the greedy fast path (share_maxima, a (rows + 1) x 3 all-gather,
split_argmax). Arms alternate in blocks of REPS calls, ROUNDS times; both must give the same tokens.
Usage: python docs/data/samp17_gather_micro.py ROUNDS REPS ROWS"""
import json
import sys
import time

import torch

import treeattn as ta

VOCAB = 262_144


def bench(rank: int, world_size: int, rounds: int, reps: int, rows: int) -> dict:
    from treeattn.engine.request import SamplingParams
    from treeattn.engine.worker.runner import all_finite
    from treeattn.engine.worker.sampling import sample, share_maxima, split_argmax
    from treeattn.parallel import comm
    from treeattn.parallel.shared_memory import DEFAULT_CAPACITY_BYTES, shared_memory_group

    torch.set_num_threads(1)
    share = -(-VOCAB // world_size)
    group = shared_memory_group(None, device="cpu", capacity_bytes=max(DEFAULT_CAPACITY_BYTES, 4 * share))
    mine = torch.randn(rows, share, generator=torch.Generator().manual_seed(rank))
    greedy, generator = SamplingParams(temperature=0.0), torch.Generator().manual_seed(0)

    def full():
        pieces = comm.all_gather(mine.contiguous(), group)
        if rank == 0:
            logits = torch.cat(pieces, dim=-1)[..., :VOCAB]
            return [int(sample(logits[i : i + 1], greedy, generator)[0]) if all_finite(logits[i : i + 1]) else None
                    for i in range(rows)]

    def fast():
        maxima = share_maxima(mine, rank * share)
        pieces = comm.all_gather(torch.cat((maxima, maxima.new_zeros(1, 3))), group)
        if rank == 0:
            return split_argmax(torch.stack([piece[:-1] for piece in pieces]))

    out = {"full": [], "fast": []}
    tokens = {}
    for _ in range(rounds):
        for name, arm in (("full", full), ("fast", fast)):
            start = time.thread_time()
            for _ in range(reps):
                tokens[name] = arm()
            out[name].append(1e6 * (time.thread_time() - start) / reps)
    out["same_tokens"] = tokens["full"] == tokens["fast"]
    return out


def main() -> None:
    rounds, reps, rows = (int(a) for a in sys.argv[1:4])
    results = ta.spawn(bench, 2, rounds, reps, rows, timeout=600)
    for rank, r in enumerate(results):
        full, fast = sorted(r["full"]), sorted(r["fast"])
        print(json.dumps({"rank": rank, "rows": rows, "reps": reps, "full_us_per_step": [round(v, 1) for v in r["full"]],
                          "fast_us_per_step": [round(v, 1) for v in r["fast"]], "median_full_us": round(full[len(full) // 2], 1),
                          "median_fast_us": round(fast[len(fast) // 2], 1), "same_tokens": r["same_tokens"],
                          "loadavg": open("/proc/loadavg").read().split()[:3]}))


if __name__ == "__main__":
    main()
