"""Inclusive and leaf shares of a py-spy raw profile (`py-spy record -f raw`), over the stacks inside
RankRunner.step (idle threads excluded), less the stacks of prompt steps: those that run a frame only a
prefill chunk runs (PREFILL_ONLY; the streamed request's uncached prompt tail is one such step).

    python3 docs/data/step50_profile_summary.py PROFILE.raw [TOP [FRAME ...]]

FRAME: more frames (as py-spy names them, with file and line) that only prompt steps run, e.g. the line of
packed_matmul that multiplies a prompt chunk's rows with F.linear (its line differs between versions).
"""
import collections
import sys

PREFILL_ONLY = ("PagedBatch._attend_runs", "dequantize_packed", "_fused_flash", "_masked_attention")
top = int(sys.argv[2]) if len(sys.argv) > 2 else 60
PREFILL_ONLY += tuple(sys.argv[3:])
inclusive, leaf, total = collections.Counter(), collections.Counter(), 0
for line in open(sys.argv[1]):
    stack, _, count = line.rstrip("\n").rpartition(" ")
    frames = stack.split(";")
    if not any(f.startswith("RankRunner.step ") for f in frames) or any(f.startswith(PREFILL_ONLY) for f in frames):
        continue
    n = int(count)
    total += n
    for f in set(frames):
        inclusive[f] += n
    leaf[frames[-1]] += n
print(f"total {total}")
print("--- inclusive")
for f, n in inclusive.most_common(top):
    print(f"{100 * n / total:5.1f}% {f}")
print("--- leaf")
for f, n in leaf.most_common(top // 2):
    print(f"{100 * n / total:5.1f}% {f}")
