"""samp17 micro A/B of the local work alone, UNDER LOAD: thread CPU time (time.thread_time) per decode step of what
each rank computes and copies at the end of a 2-rank greedy step with Gemma 3's vocabulary (262,144), without the
wait for the other rank (one process: SharedMemoryGroup.all_gather's copies, its slot written and every slot cloned,
done on plain tensors). "full" = today's path (rank 0 then concatenates, all_finite, greedy sample()), "fast" = the
greedy fast path (share_maxima, a (rows + 1) x 3 float64 gather, rank 0 split_argmax). Arms alternate in blocks of
REPS, ROUNDS times; both must give the same tokens.  Usage: python docs/data/samp17_local_micro.py ROUNDS REPS ROWS"""
import json
import sys
import time

import torch

from treeattn.engine.request import SamplingParams
from treeattn.engine.worker.runner import all_finite
from treeattn.engine.worker.sampling import sample, share_maxima, split_argmax

VOCAB, RANKS = 262_144, 2


def main() -> None:
    rounds, reps, rows = (int(a) for a in sys.argv[1:4])
    torch.set_num_threads(1)
    share = VOCAB // RANKS
    shares = [torch.randn(rows, share, generator=torch.Generator().manual_seed(r)) for r in range(RANKS)]
    big, small = torch.empty(RANKS, rows, share), torch.empty(RANKS, rows + 1, 3, dtype=torch.float64)
    greedy, generator = SamplingParams(temperature=0.0), torch.Generator().manual_seed(0)

    def full(rank):
        big[rank].copy_(shares[rank])
        pieces = [slot.clone() for slot in big]
        if rank == 0:
            logits = torch.cat(pieces, dim=-1)[..., :VOCAB]
            return [int(sample(logits[i : i + 1], greedy, generator)[0]) if all_finite(logits[i : i + 1]) else None
                    for i in range(rows)]

    def fast(rank):
        maxima = share_maxima(shares[rank], rank * share)
        small[rank].copy_(torch.cat((maxima, maxima.new_zeros(1, 3))))
        pieces = [slot.clone() for slot in small]
        if rank == 0:
            return split_argmax(torch.stack([piece[:-1] for piece in pieces]))

    for rank in (1, 0):  # rank 1 first: its share is in the slots when rank 0 reads them
        full(rank), fast(rank)
    times = {(rank, name): [] for rank in range(RANKS) for name in ("full", "fast")}
    for _ in range(rounds):
        for name, arm in (("full", full), ("fast", fast)):
            for rank in range(RANKS):
                start = time.thread_time()
                for _ in range(reps):
                    arm(rank)
                times[rank, name].append(1e6 * (time.thread_time() - start) / reps)
    same = full(0) == fast(0)
    for rank in range(RANKS):
        f, s = sorted(times[rank, "full"]), sorted(times[rank, "fast"])
        print(json.dumps({"rank": rank, "rows": rows, "reps": reps, "full_us": [round(v, 1) for v in times[rank, "full"]],
                          "fast_us": [round(v, 1) for v in times[rank, "fast"]], "median_full_us": round(f[len(f) // 2], 1),
                          "median_fast_us": round(s[len(s) // 2], 1), "same_tokens": same,
                          "loadavg": open("/proc/loadavg").read().split()[:3]}))


if __name__ == "__main__":
    main()
