"""What sampling one token costs on the CPU with chat's settings, at SmolLM2's and Gemma 3's vocabulary sizes.

    python3 benchmarks/engine/sampling_cost.py [--repeats 20]

Times treeattn.engine.worker.sampling.sample (temperature 0.7, top-p 0.9, repetition penalty 1.1 over a
100-token prompt and 30 output tokens: `treeattn chat`'s defaults) on one row of logits, thread CPU on one
torch thread, for two shapes of logits: "peaked" (30 tokens 12 above a N(0, 2) rest: a language model's usual
next-token distribution) and "flat" (N(0, 3): a nucleus of thousands of tokens). Beside it, a stable float64
sort of the whole vocabulary: what top-p cost when it sorted every logit (sessions up to 23).
"""

from __future__ import annotations

import argparse
import os
import time

import torch

import treeattn as ta
from treeattn.engine.worker.sampling import sample


def thread_ms(fn, repeats: int) -> float:
    """Mean thread CPU milliseconds of fn() over `repeats` calls after 3 warm-up calls."""
    for _ in range(3):
        fn()
    start = time.thread_time_ns()
    for _ in range(repeats):
        fn()
    return (time.thread_time_ns() - start) / repeats / 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(1)
    params = ta.SamplingParams(temperature=0.7, top_p=0.9, repetition_penalty=1.1)
    prompt, output = list(range(100)), list(range(200, 230))
    generator = torch.Generator().manual_seed(0)
    print(f"load average before: {os.getloadavg()}; one torch thread, thread CPU ms a call, {args.repeats} calls")
    for vocab in (49152, 262144):
        g = torch.Generator().manual_seed(vocab)
        peaked = torch.randn(1, vocab, generator=g) * 2
        peaked[0, torch.randint(0, vocab, (30,), generator=g)] += 12
        flat = torch.randn(1, vocab, generator=g) * 3
        times = {name: thread_ms(lambda x=x: sample(x, params, generator, prompt_ids=prompt, output_ids=output), args.repeats)
                 for name, x in (("peaked", peaked), ("flat", flat))}
        whole = flat.double()
        sort = thread_ms(lambda: torch.sort(whole, dim=-1, descending=True, stable=True), args.repeats)
        print(f"vocabulary {vocab:6d}: sample peaked {times['peaked']:6.2f} ms, flat {times['flat']:6.2f} ms; "
              f"a stable sort of every logit {sort:6.2f} ms")
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
