"""The table of gpu18's runs: ms/token, prefill, and where each run's greedy tokens first differ from its reference."""
import json
import pathlib
import sys

w = pathlib.Path(sys.argv[1])
runs = {}
for f in sorted(w.glob("*.json")):
    try:
        runs[f.stem] = json.loads(f.read_text())
    except ValueError:
        print(f"{f.stem}: no JSON ({(w / (f.stem + '.err')).read_text()[-300:]!r})" if (w / (f.stem + ".err")).exists() else f.stem)


def ids(r):
    g = r.get("generated_ids") or []
    return g[0] if g and isinstance(g[0], list) else g


def first_diff(a, b):
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), None)


REFS = {"smol_packed_graph": "smol_packed_dynamic", "smol_dequantize_dynamic": "smol_packed_dynamic",
        "smol_dequantize_graph": "smol_dequantize_dynamic", "gemma_graph": "gemma_dynamic",
        "llama1b_dequantize_graph": "llama1b_packed_graph", "llama1b_dequantize_dynamic": "llama1b_packed_dynamic"}
print(f"{'run':26} {'prompt':>6} {'new':>4} {'ms/token':>9} {'prefill s':>9} {'act/kv':>17} {'weights':>10}  tokens vs reference")
for name, r in runs.items():
    if "generated_ids" not in r:
        continue
    t, toks = r.get("timings", {}), ids(r)
    notes = []
    for ref in filter(None, [REFS.get(name), "smol_cpu_f32" if name.startswith("smol_") and name != "smol_cpu_f32" else None,
                             "gemma_cpu_f32" if name.startswith("gemma_") and name != "gemma_cpu_f32" else None]):
        if ref in runs and "generated_ids" in runs[ref]:
            d = first_diff(toks, ids(runs[ref]))
            n = min(len(toks), len(ids(runs[ref])))
            notes.append(f"{ref}: " + (f"same first {n}" if d is None else f"differ at {d} of {n}"))
    print(f"{name:26} {r.get('prompt_tokens', '?'):>6} {len(toks):>4} {1e3 * t.get('time_per_token_s', float('nan')):>9.2f} "
          f"{t.get('prefill_s', float('nan')):>9.2f} {str(r.get('activation_format')) + '/' + str(r.get('kv_cache_dtype')):>17} {str(r.get('weight_format')):>10}  {'; '.join(notes)}")
