"""How far MKL's and oneDNN's float32 LM head products of real prompt rows are from float64, side by side.

    python3 benchmarks/engine/prompt_logprobs_product_oracle.py SmolLM2.gguf --context 1200

One engine (1 rank in this process) prefills one prompt of random token ids with prompt_logprobs=0; the final
hidden states that the scoring receives are kept. For every row: the logits in float64 (the head's float32 copy and
the rows, in float64), by F.linear (MKL's sgemm) and by ops.dense_linear.linear_float32 (oneDNN's matmul), each
row's log-softmax at its target and its rank (1 + the logits above the target's). Prints, per product, the largest
and mean logit error against float64, the largest logprob error, and the number of rows whose rank differs from
float64's (near-ties within float32 rounding: a count both float32 products share).
"""

from __future__ import annotations

import json

import torch
import torch.nn.functional as F

from treeattn.bench import harness
from treeattn.ops.dense_linear import linear_float32


def main() -> None:
    parser = harness.parser(__doc__, model="required", context=1200)
    args = harness.parse_args(parser)
    hidden, targets, head = harness.scored_rows(args.model, args.context)
    rows = torch.arange(len(targets))

    def scored(logits):
        logprob = logits.double()[rows, targets] - torch.logsumexp(logits.double(), dim=-1)
        return logprob, (logits > logits[rows, targets][:, None]).sum(dim=-1) + 1

    exact = hidden.double() @ head.double().T
    exact_logprob, exact_rank = scored(exact)
    result = {"model": args.model, "rows": len(targets), "max_abs_logit": exact.abs().max().item()}
    for name, product in (("mkl", F.linear), ("onednn", linear_float32)):
        logits = product(hidden, head)
        logprob, rank = scored(logits)
        result[name] = {"max_logit_error": (logits.double() - exact).abs().max().item(),
                        "mean_logit_error": (logits.double() - exact).abs().mean().item(),
                        "max_logprob_error": (logprob - exact_logprob).abs().max().item(),
                        "ranks_differing_from_float64": int((rank != exact_rank).sum())}
    result["loadavg"] = open("/proc/loadavg").read().split()[:3]
    print(json.dumps(result, indent=1))
    harness.write_output(args.output, [result])


if __name__ == "__main__":
    main()
