#!/usr/bin/env bash
# A/B of `python -m treeattn.ops.warmup` from an empty numba cache (as in a fresh clone): --jobs 1 (serial, as before)
# against --jobs 2 (two processes on disjoint kernel groups), alternated ABAB, each into a fresh NUMBA_CACHE_DIR.
# Run from the worktree root: bash docs/data/ci21/warmup_ab.sh > docs/data/ci21/warmup_ab.txt 2>&1
cd "$(dirname "$0")/../../.."
lscpu | grep "Model name"
for arm in 1 2 1 2; do
    dir=$(mktemp -d)
    echo "--- jobs=$arm start $(date -u +%T) load: $(cut -d' ' -f1-3 /proc/loadavg)"
    /usr/bin/time -f "jobs=$arm real %e s user %U s sys %S s" env NUMBA_CACHE_DIR="$dir" PYTHONPATH="$PWD/src" \
        python3 -m treeattn.ops.warmup --jobs $arm
    echo "    end load: $(cut -d' ' -f1-3 /proc/loadavg)"
    rm -rf "$dir"
done
