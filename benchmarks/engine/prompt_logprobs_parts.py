"""The CPU seconds of prompt logprobs' parts for one block of rows, one thread, alternately.

    python benchmarks/engine/prompt_logprobs_parts.py SmolLM2.gguf --repeats 5

For a model whose output projection is kept packed (a GGUF file): dequantizing the whole head (what the
packed layer did for every block of rows before dense_head kept one copy), the block's float32 LM head
product at once and a vocabulary chunk at a time (vocab_columns: the floor of any exact method; through
model.logits, a fresh tensor a chunk, as _score_block does, and into one reused buffer with torch.mm(out=)), and the
whole scoring of the block (the chunked product with each chunk's reductions: its max, sum of exponentials,
count of larger logits; treeattn.engine.worker.prompt_logprobs). One torch thread and time.thread_time, so
that on a loaded machine the figures are the CPU each part costs, not the wait for a core. Prints one JSON
object: each part's CPU seconds per repeat and their minimum, the rows per block, the load average.
"""

from __future__ import annotations

import json
import time

import torch

import treeattn.engine.worker.prompt_logprobs as pl
from treeattn.bench import harness


def main() -> None:
    parser = harness.parser(__doc__, model="required", output=False, repeats=5)
    args = harness.parse_args(parser)
    from treeattn.models.loader import load_model

    torch.set_num_threads(1)
    model = load_model(args.model, weight_format="auto")
    head = model.embed_tokens if model.lm_head is None else model.lm_head
    if not hasattr(head, "dequantized"):
        raise SystemExit(f"MODEL: {args.model}'s output projection is not kept packed (a GGUF file's q4_0/q4_1/q8_0 head is)")
    rows, g = pl.ROWS_PER_BLOCK, torch.Generator().manual_seed(0)
    hidden = torch.randn(rows, model.config.hidden_size, generator=g)
    targets = torch.randint(0, model.config.vocab_size, (rows,), generator=g)
    weight = head.dequantized()
    out = torch.empty(rows, 2, dtype=torch.float64)
    columns = pl.vocab_columns(rows, model.config.vocab_size)

    def chunked_product():
        for first in range(0, model.config.vocab_size, columns):
            model.logits(hidden, slice(first, first + columns), weight=weight)

    buffer = torch.empty(rows, columns)

    def chunked_product_into_one_buffer():  # whether a fresh tensor a chunk costs anything
        for first in range(0, model.config.vocab_size, columns):
            part = weight[first : first + columns]
            torch.mm(hidden, part.T, out=buffer if part.shape[0] == columns else torch.empty(rows, part.shape[0]))

    parts = {"dequantize the head": head.dequantized,
             "LM head product, whole block": lambda: model.logits(hidden, weight=weight),
             "LM head product, by vocabulary chunks": chunked_product,
             "LM head product, by vocabulary chunks into one buffer": chunked_product_into_one_buffer,
             "block scored (chunked product + reductions)": lambda: pl._score_block(model, hidden, targets, 0, out,
                                                                                   pl._Head.of(model))}
    seconds = {name: [] for name in parts}
    for _ in range(args.repeats):
        for name, part in parts.items():
            start = time.thread_time()
            part()
            seconds[name].append(time.thread_time() - start)
    print(json.dumps({"model": args.model, "rows_per_block": rows, "vocab_columns": columns,
                      "vocab_size": model.config.vocab_size,
                      "hidden_size": model.config.hidden_size, "cpu_s_min": {k: min(v) for k, v in seconds.items()},
                      "cpu_s": seconds, "loadavg": open("/proc/loadavg").read().split()[:3]}, indent=1))


if __name__ == "__main__":
    main()
