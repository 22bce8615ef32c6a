#!/usr/bin/env bash
# The full suite on branch ci21 as CI runs it after install (warm-up, then README's test command, with --durations=0).
# Run from the worktree root: bash docs/data/ci21/full_suite.sh > docs/data/ci21/full_suite.txt 2>&1
cd "$(dirname "$0")/../../.."
export PYTHONPATH=$PWD/src
echo "$(git log --oneline -1); $(lscpu | grep 'Model name'); start $(date -u +%T); load $(cut -d' ' -f1-3 /proc/loadavg)"
/usr/bin/time -f "warm-up real %e s user %U s" python3 -m treeattn.ops.warmup
echo "pytest start $(date -u +%T); load $(cut -d' ' -f1-3 /proc/loadavg)"
/usr/bin/time -f "pytest real %e s user %U s" python3 -m pytest -q --durations=0 -p no:cacheprovider
echo "end $(date -u +%T); load $(cut -d' ' -f1-3 /proc/loadavg)"
