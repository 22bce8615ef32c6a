"""score_rows over an 8K prompt's rows with the LM head multiplied three ways, alternated in one process.

    python3 benchmarks/engine/prompt_logprobs_head_ab.py SmolLM2.gguf --rows 8000 --repeats 3

The model's final hidden states are stood in for by random rows (the product's speed does not depend on the values),
the targets are random token ids; torch on its default threads (a rank's: chunk_pool splits the chunks). Variants, in
an order rotated from repeat to repeat:
- "mkl_plain": ops.dense_linear's rule on an Intel CPU, MKL's sgemm of the head's plain float32 copy (dense_head);
- "onednn_plain": oneDNN's matmul of the same copy (session 19's code on any CPU);
- "onednn_prepacked": oneDNN's matmul of the head prepacked by vocabulary chunks (prepacked_head: a non-Intel CPU's
  path since session 20).
Per run: wall seconds and process CPU seconds. Then per repeat the ratios (onednn_plain / mkl_plain,
onednn_prepacked / mkl_plain, onednn_prepacked / onednn_plain), their medians and means, the largest logprob difference
between the variants, the CPU model and the load average at the start and the end. --output keeps the JSON.
"""

from __future__ import annotations

import json
import statistics
import time

import torch

from treeattn.bench import harness
from treeattn.engine.worker import prompt_logprobs
from treeattn.ops import dense_linear

VARIANTS = ("mkl_plain", "onednn_plain", "onednn_prepacked")


def main() -> None:
    parser = harness.parser(__doc__, model="required", output=True, repeats=3)
    parser.add_argument("--rows", type=int, default=8000)
    args = harness.parse_args(parser)
    from treeattn.models.loader import load_model

    load_start = open("/proc/loadavg").read().split()[:3]
    model = load_model(args.model, weight_format="auto")
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(args.rows, model.config.hidden_size, generator=g)
    targets = torch.randint(0, model.config.vocab_size, (args.rows,), generator=g)
    prepacked_head, vendors = prompt_logprobs.prepacked_head, dense_linear.MKL_VENDORS

    def use(variant: str) -> None:
        dense_linear.MKL_VENDORS = (dense_linear.cpu_vendor(),) if variant == "mkl_plain" else ()
        prompt_logprobs.prepacked_head = prepacked_head if variant == "onednn_prepacked" else (lambda model: None)

    values, runs = {}, {v: {"wall_s": [], "cpu_s": []} for v in VARIANTS}
    for variant in VARIANTS:  # the head's copy and its chunks made before any timed run
        use(variant)
        values[variant] = prompt_logprobs.score_rows(model, hidden[:600], targets[:600], 0)
    for r in range(args.repeats):
        for variant in VARIANTS[r % 3:] + VARIANTS[: r % 3]:
            use(variant)
            wall, cpu = time.perf_counter(), time.process_time()
            values[variant] = prompt_logprobs.score_rows(model, hidden, targets, 0)
            runs[variant]["cpu_s"].append(round(time.process_time() - cpu, 3))
            runs[variant]["wall_s"].append(round(time.perf_counter() - wall, 3))
    dense_linear.MKL_VENDORS, prompt_logprobs.prepacked_head = vendors, prepacked_head
    ratios = {}
    for top, bottom in (("onednn_plain", "mkl_plain"), ("onednn_prepacked", "mkl_plain"),
                        ("onednn_prepacked", "onednn_plain")):
        for kind in ("wall_s", "cpu_s"):
            each = [a / b for a, b in zip(runs[top][kind], runs[bottom][kind])]
            ratios[f"{top} / {bottom} {kind}"] = {"rounds": [round(x, 3) for x in each],
                                                  "median": round(statistics.median(each), 3),
                                                  "mean": round(statistics.mean(each), 3)}
    result = {"model": args.model, "rows": args.rows, "torch_threads": torch.get_num_threads(),
              "cpu": open("/proc/cpuinfo").read().split("model name")[1].split("\n")[0].strip(": "),
              "runs": runs, "ratios": ratios,
              "max_logprob_difference": {v: (values[v][:, 0] - values["mkl_plain"][:, 0]).abs().max().item()
                                         for v in VARIANTS[1:]},
              "loadavg_start": load_start, "loadavg_end": open("/proc/loadavg").read().split()[:3]}
    print(json.dumps(result, indent=1))
    harness.write_output(args.output, [result])


if __name__ == "__main__":
    main()
