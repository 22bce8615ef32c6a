"""Median and minimum CPU ms per decode step of main and the branch in an alternated A/B file of
step50_cpu_step.py runs (lines "<tree> cpu_ms_per_step X wall_ms_per_step Y tokens [...] load L"), and
whether every run gave the same tokens.

    python3 docs/data/step50_ab_summary.py AB.txt [...]
"""
import collections
import statistics
import sys

for path in sys.argv[1:]:
    cpu, tokens = collections.defaultdict(list), set()
    for line in open(path):
        parts = line.split()
        if len(parts) > 4 and parts[1] == "cpu_ms_per_step":
            tree = "main" if "/work/main/" in parts[0] else "branch"
            cpu[tree].append(float(parts[2]))
            tokens.add(line[line.index("tokens") : line.index("] load")])
    cells = [f"{t} n={len(v)} median {statistics.median(v):.1f} min {min(v):.1f}" for t, v in sorted(cpu.items(), reverse=True)]
    ratio = (statistics.median(cpu["branch"]) / statistics.median(cpu["main"])) if cpu["main"] and cpu["branch"] else float("nan")
    print(f"{path}: {'; '.join(cells)}; branch/main medians {ratio:.2f}; same tokens in every run: {len(tokens) == 1}")
