# python3 docs/data/dec22/ab_summary.py docs/data/dec22/ab_*.txt: per pair, main and branch median / min thread CPU ms a step, the ratios (median, min, mean) and whether the tokens are equal
import json, sys
for f in sys.argv[1:]:
    lines = open(f).read().splitlines()
    rows = [json.loads(l.split(" ", 1)[1].strip()) for l in lines if l.startswith(("main ", "branch ")) and "{" in l]
    pairs = [l for l in lines if l.startswith("# pair")]
    for i in range(0, len(rows) - 1, 2):
        m, b = rows[i], rows[i + 1]
        r = lambda k: b[k] / m[k]
        print(f.split("/")[-1], pairs[i // 2][2:], f"| main {m['step_ms_median']:.2f} / {m['step_ms_min']:.2f} | branch {b['step_ms_median']:.2f} / {b['step_ms_min']:.2f} | {r('step_ms_median'):.3f} | {r('step_ms_min'):.3f} | {r('step_ms_mean'):.3f} | {m['token_ids'] == b['token_ids']} {len(m['token_ids'])}")
