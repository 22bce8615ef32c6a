"""Merge `treeattn eval ruler --output` reports of the same model, seed and samples run in separate
invocations, and compare every sample's generated token ids across the rank counts that ran it."""
import json
import sys

by_sample, table = {}, {}
for path in sys.argv[1:]:
    d = json.load(open(path))
    for r in d["results"]:
        by_sample.setdefault((r["task"], r["context"], r["index"]), {})[r["nproc"]] = r["generated_ids"]
        table[(r["task"], r["context"], r["nproc"])] = (r["score"], r["ttft_s"] + r["decode_s"], r["prompt_tokens"])
for (task, context, index), ids in sorted(by_sample.items()):
    ranks = sorted(ids)
    same = len({tuple(v) for v in ids.values()}) == 1
    cells = "  ".join(f"p={p}: {100 * table[(task, context, p)][0]:.0f} % / {table[(task, context, p)][1]:.0f} s" for p in ranks)
    print(f"{task:16s} {context:6d} #{index} prompt {table[(task, context, ranks[0])][2]} tokens  {cells}  "
          f"identical on {ranks}: {'yes' if same and len(ranks) > 1 else ('only one rank count' if len(ranks) == 1 else 'NO')}")
