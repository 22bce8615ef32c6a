"""Summarize a CI22_LOG: per worker busy time and last end, per file wall (sum of its tests), the tail."""
import collections
import sys

rows = [line.rstrip("\n").split("\t") for line in open(sys.argv[1])]
rows = [(w, float(s), float(e), n) for w, s, e, n in rows]
t0 = min(s for _, s, _, _ in rows)
workers = collections.defaultdict(list)
files = collections.defaultdict(float)
for w, s, e, n in rows:
    workers[w].append((s, e, n))
    files[(w, n.split("::")[0])] += e - s
for w, tests in sorted(workers.items()):
    busy = sum(e - s for s, e, _ in tests)
    print(f"{w}: {len(tests)} tests, busy {busy:.0f} s, first start {min(s for s,_,_ in tests)-t0:.0f} s, "
          f"last end {max(e for _,e,_ in tests)-t0:.0f} s")
ends = sorted(max(e for _, e, _ in t) - t0 for t in workers.values())
print(f"tail (one worker alone): {ends[-1]-ends[0]:.0f} s")
print("slowest files (worker, file, s):")
for (w, f), s in sorted(files.items(), key=lambda x: -x[1])[:25]:
    print(f"  {w} {s:7.1f} {f}")
last = {}
for w, tests in workers.items():
    fs = []
    for s, e, n in sorted(tests):
        f = n.split("::")[0]
        if not fs or fs[-1][0] != f:
            fs.append([f, s - t0, e - t0])
        else:
            fs[-1][2] = e - t0
    print(f"{w} last 5 files (file, start, end):", [(f, round(a), round(b)) for f, a, b in fs[-5:]])
