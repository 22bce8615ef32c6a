#!/usr/bin/env bash
# CPU seconds of each half of `python -m treeattn.ops.warmup` (--part 0/2, --part 1/2), each from an empty numba
# cache, one after the other: on an idle 2-core host the two run side by side, so the install's warm-up takes about
# the larger one. Run from the worktree root: bash docs/data/ci21/warmup_parts.sh > docs/data/ci21/warmup_parts.txt 2>&1
cd "$(dirname "$0")/../../.."
lscpu | grep "Model name"
for part in 0/2 1/2; do
    dir=$(mktemp -d)
    echo "--- part $part start $(date -u +%T) load: $(cut -d' ' -f1-3 /proc/loadavg)"
    /usr/bin/time -f "part $part real %e s user %U s sys %S s" env NUMBA_CACHE_DIR="$dir" PYTHONPATH="$PWD/src" \
        python3 -m treeattn.ops.warmup --part $part
    rm -rf "$dir"
done
