"""The reductions of prompt logprobs over one block of logits: all rows at once vs rows_per_pass(V) rows at a time.

    python benchmarks/engine/prompt_logprobs_reductions.py --rows 256 --vocab 49152 --hidden 576 --rounds 5

One block of logits (rows x vocab, float32, from a random hidden state and LM head of SmolLM2's shape
by default), then, alternately in each round: the block's matrix product, the log-softmax at the
targets, the ranks and the top k over the whole block at once (as before), and the same reductions
rows_per_pass(V) rows at a time, or --rows-per-pass (what treeattn.engine.worker.prompt_logprobs.score_rows did
in session 14; it now computes the logits a vocabulary chunk at a time and reduces each chunk while it is in
the cache: benchmarks/engine/prompt_logprobs_parts.py). Checks that both give the same values bit for bit;
prints one JSON object with the milliseconds of each round and the load average.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F

PASS_BYTES = 2 << 20  # session 14's rows a pass: 2 MiB of logits


def rows_per_pass(vocab_size: int) -> int:
    return max(1, PASS_BYTES // (4 * vocab_size))


def _score_block(logits: torch.Tensor, targets: torch.Tensor, top: int, out: torch.Tensor, step: int) -> None:
    """Session 14's reductions of a block's logits (rows, V), `step` rows at a time, into `out`."""
    n = logits.shape[0]
    chosen = logits.gather(1, targets[:, None])
    lse = logits.new_empty(n)
    larger = torch.empty(n, dtype=torch.int64)
    values, ids = logits.new_empty(n, top), torch.empty(n, top, dtype=torch.int64)
    for first in range(0, n, step):
        rows, part = logits[first : first + step], slice(first, first + step)
        torch.logsumexp(rows, dim=-1, out=lse[part])
        torch.sum(rows > chosen[part], dim=-1, out=larger[part])
        if top:
            torch.topk(rows, top, dim=-1, out=(values[part], ids[part]))
    out[:, 0] = chosen.squeeze(1) - lse
    out[:, 1] = larger + 1
    if top:
        out[:, 2 : 2 + top] = values - lse[:, None]
        out[:, 2 + top :] = ids


def whole(logits: torch.Tensor, targets: torch.Tensor, top: int) -> torch.Tensor:
    out = torch.empty(logits.shape[0], 2 + 2 * top, dtype=torch.float64)
    _score_block(logits, targets, top, out, logits.shape[0])
    return out


def by_pass(logits: torch.Tensor, targets: torch.Tensor, top: int, step: int) -> torch.Tensor:
    out = torch.empty(logits.shape[0], 2 + 2 * top, dtype=torch.float64)
    _score_block(logits, targets, top, out, step)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--hidden", type=int, default=576)
    parser.add_argument("--top", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rows-per-pass", type=int, default=None, help="default: rows_per_pass(vocab)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    step = args.rows_per_pass or rows_per_pass(args.vocab)
    load_start = open("/proc/loadavg").read().split()[:3]
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(args.vocab, args.hidden, generator=g) * 0.05
    hidden = torch.randn(args.rows, args.hidden, generator=g)
    targets = torch.randint(0, args.vocab, (args.rows,), generator=g)
    logits = F.linear(hidden, weight)
    assert torch.equal(whole(logits, targets, args.top), by_pass(logits, targets, args.top, step))
    rounds = []
    for _ in range(args.rounds):
        row = {}
        for name, fn in (("matmul", lambda: F.linear(hidden, weight)), ("whole", lambda: whole(logits, targets, args.top)),
                         ("by_pass", lambda: by_pass(logits, targets, args.top, step))):
            start = time.perf_counter()
            fn()
            row[name + "_ms"] = 1000 * (time.perf_counter() - start)
        rounds.append(row)
    print(json.dumps({"rows": args.rows, "vocab": args.vocab, "hidden": args.hidden, "top": args.top, "threads": args.threads,
                      "rows_per_pass": step, "identical": True, "rounds": rounds,
                      "loadavg_start": load_start, "loadavg_end": open("/proc/loadavg").read().split()[:3]}, indent=1))


if __name__ == "__main__":
    main()
