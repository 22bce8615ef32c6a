#!/bin/bash
# ABAB: step_cpu.py (beside this script) under A = main 3e3694a (git archive into /tmp/f32h21/base/src) and B = branch
# f32h21 (/work/wt/f32h21/src), ROUNDS rounds, TOKENS tokens, MODEL (a `treeattn models` name): process CPU ms of each decode step, one rank, one thread.
D=$(dirname $(readlink -f $0))
for round in $(seq 1 ${ROUNDS:-3}); do
  for ab in A B; do
    if [ $ab = A ]; then S=/tmp/f32h21/base/src; else S=/work/wt/f32h21/src; fi
    echo "## $ab round $round $(date -u +%T) load $(cut -d' ' -f1-3 /proc/loadavg)"
    PYTHONPATH=$S python3 $D/step_cpu.py ${TOKENS:-32} ${MODEL:-smollm2} 2>/dev/null
  done
done
