#!/bin/bash
# Session 18 (dec18): docs/data/dec18_profile.py (the real Generation of `treeattn generate`, prefill included, timers
# around the kernels) alternated between GOMP_SPINCOUNT=300000 (libgomp's default) and 10000 (treeattn.openmp's).
#   bash docs/data/dec18_ab_profile.sh MODEL CONTEXT ROUNDS
M=$1; CTX=${2:-4096}; ROUNDS=${3:-1}
cd "$(dirname "$0")/../.." && export PYTHONPATH=$PWD/src
echo "# $(date -u +%FT%TZ) git $(git log --oneline -1 | cut -c1-60) cpu $(lscpu | grep 'Model name' | tr -s ' ' | cut -d: -f2)"
echo "# bash docs/data/dec18_ab_profile.sh $M $CTX $ROUNDS"
for r in $(seq 1 $ROUNDS); do
  if (( r % 2 )); then arms="300000 10000"; else arms="10000 300000"; fi
  for spin in $arms; do
    echo "## round $r GOMP_SPINCOUNT=$spin $(date -u +%T) load $(cut -d' ' -f1-3 /proc/loadavg)"
    GOMP_SPINCOUNT=$spin python3 docs/data/dec18_profile.py "$M" --context $CTX 2>&1 | grep '^{'
  done
done
