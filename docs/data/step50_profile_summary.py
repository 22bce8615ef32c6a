"""Inclusive and leaf shares of a py-spy raw profile (`py-spy record -f raw`), over the stacks inside
RankRunner.step (decode steps; the prompt's prefill and idle threads excluded).

    python3 docs/data/step50_profile_summary.py PROFILE.raw [TOP]
"""
import collections
import sys

top = int(sys.argv[2]) if len(sys.argv) > 2 else 60
inclusive, leaf, total = collections.Counter(), collections.Counter(), 0
for line in open(sys.argv[1]):
    stack, _, count = line.rstrip("\n").rpartition(" ")
    frames = stack.split(";")
    if not any(f.startswith("RankRunner.step ") or f.startswith("step (treeattn/engine/worker/runner.py") for f in frames):
        continue
    n = int(count)
    total += n
    for f in set(frames):
        inclusive[f.split(" (")[0] + " (" + f.split(" (", 1)[1] if " (" in f else f] += n
    leaf[frames[-1]] += n
print(f"total {total}")
print("--- inclusive")
for f, n in inclusive.most_common(top):
    print(f"{100 * n / total:5.1f}% {f}")
print("--- leaf")
for f, n in leaf.most_common(top // 2):
    print(f"{100 * n / total:5.1f}% {f}")
