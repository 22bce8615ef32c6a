"""python benchmarks/engine/activation_format_agreement.py MODEL.gguf 64  (issue 50) -- Token agreement of activation_format int8
vs float32: greedy tokens from a few prompts, one engine per setting."""
import sys
import json
import treeattn as ta
from treeattn.models.loader import read_model_files
path, n = sys.argv[1], int(sys.argv[2])
prompts = ["The capital of France is", "Once upon a time, in a small village,", "def fibonacci(n):",
           "The three laws of thermodynamics are", "Water boils at", "In 1492, Columbus"]
tok = read_model_files(path).tokenizer
ids = [tok.encode(p).ids if hasattr(tok.encode(p), "ids") else tok.encode(p) for p in prompts]
out = {}
for fmt in ("float32", "int8"):
    with ta.Engine(path, nproc=1, weight_format="packed", activation_format=fmt, max_batch_size=1) as e:
        out[fmt] = [e.generate([p], max_new_tokens=n, temperature=0.0, ignore_eos=True)[0].token_ids for p in ids]
rows = []
for p, a, b in zip(prompts, out["float32"], out["int8"]):
    same = sum(x == y for x, y in zip(a, b))
    first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
    rows.append({"prompt": p, "equal_positions": same, "first_difference": first, "of": len(a)})
    print(json.dumps(rows[-1]))
tot = sum(r["equal_positions"] for r in rows)
prefix = sum(r["first_difference"] for r in rows)
N = sum(r["of"] for r in rows)
print(json.dumps({"model": path.split("/")[-1], "tokens": N, "equal_positions": tot, "common_prefix_tokens": prefix}))
