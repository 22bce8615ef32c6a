"""How many vocabulary columns a bf16x1 screen would leave to multiply in float32 (docs/engine.md, Session 21).

    PYTHONPATH=$PWD/src python3 docs/data/logp21/screening_estimate.py SMOLLM2 --context 1200

Real final hidden states (as prompt_logprobs_split_bf16.py); per row a = bf16x1 logits, bound b = 2**-8 * (|x| @ |W|.T)
* 1.01 (bfloat16 rounds x and W each within 2**-9 relatively; their product within ~2**-8). Columns needed exactly:
"rank": |a_v - a_target| <= b_v + b_target (whether v's logit is above the target's is undecided);
"lse": a_v + b_v >= max(a) - T, T such that every column below holds under 1e-7 of the row's softmax mass in all
(V * exp(-T) <= 1e-7). Prints per 512-row block the union's size over its rows, and the mean per row.
"""
import json
import math
import sys

import torch

sys.path.insert(0, "benchmarks/engine")
from prompt_logprobs_split_bf16 import hidden_states, product  # noqa: E402

from treeattn.bench import harness  # noqa: E402

parser = harness.parser(__doc__, model="required", output=False, context=1200)
args = harness.parse_args(parser)
hidden, targets, head = hidden_states(args.model, args.context)
V = head.shape[0]
T = math.log(V / 1e-7)
out = {"rows": hidden.shape[0], "vocab": V, "T": T, "loadavg": open("/proc/loadavg").read().split()[:3], "blocks": []}
for lo in range(0, hidden.shape[0], 512):
    x, t = hidden[lo : lo + 512], targets[lo : lo + 512]
    a = product("bf16x1", x, head)
    b = (x.abs() @ head.abs().T) * 2.0**-8 * 1.01
    rows = torch.arange(len(t))
    at, bt = a[rows, t][:, None], b[rows, t][:, None]
    rank = (a - at).abs() <= b + bt
    lse = a + b >= a.amax(dim=1, keepdim=True) - T
    out["blocks"].append({"rows": len(t), "rank_union": int(rank.any(0).sum()),
                          "rank_mean_row": rank.sum(1).float().mean().item(),
                          "lse_union": int(lse.any(0).sum()), "lse_mean_row": lse.sum(1).float().mean().item(),
                          "both_union": int((rank | lse).any(0).sum()),
                          "bound_mean": b.mean().item(), "bound_max": b.max().item()})
print(json.dumps(out, indent=1))
