#!/usr/bin/env bash
# ABAB: serial (-n 0) vs two workers (-n 2 --dist loadfile) on the same subset of files, alternated.
cd /work/wt/ci22
FILES="tests/test_parallel_errors.py tests/test_spawn_faults.py tests/test_engine_hostile.py tests/test_serve_controls.py tests/test_bench_faults.py tests/test_launch.py tests/test_shared_memory.py tests/test_bifurcated.py tests/test_numba_cache.py tests/test_started_ranks.py"
out=docs/data/ci22/ab_subset.txt
{
echo "# ABAB on Intel Xeon ($(lscpu | grep 'Model name' | sed 's/  */ /g'), $(nproc) cores), commit $(git rev-parse --short HEAD), $(date -u)"
echo "# files: $FILES"
echo "# A: PYTHONPATH=\$PWD/src python3 -m pytest -q -n 0 \$FILES ; B: the same with -n 2 --dist loadfile"
for round in 1 2; do
  for mode in A B; do
    if [ $mode = A ]; then args="-n 0"; else args="-n 2 --dist loadfile"; fi
    echo "## round $round $mode ($args) uptime before: $(uptime)"
    s=$(date +%s.%N)
    PYTHONPATH=$PWD/src python3 -m pytest -q $args --durations=0 $FILES > /tmp/ci22_ab_${round}_${mode}.log 2>&1
    rc=$?
    e=$(date +%s.%N)
    echo "## round $round $mode rc $rc wall $(python3 -c "print(round($e-$s,1))") s; $(grep -E 'passed|failed' /tmp/ci22_ab_${round}_${mode}.log | tail -1)"
    echo "## uptime after: $(uptime)"
  done
done
} > $out 2>&1
