#!/bin/bash
# Session 18 (dec18): alternated A/B of one rank's decode step (docs/data/dec18_step.py, no prefill) between
# libgomp's default spin (GOMP_SPINCOUNT=300000) and 10000 spins (the raw file of 21:45 ran its 'new' arm through a
# since-removed treeattn.openmp that set GOMP_SPINCOUNT=10000 at 'import treeattn'; the same setting)
# one process per arm, ROUNDS rounds, the arms' order swapped every round.
#   bash docs/data/dec18_ab.sh MODEL "4096 8192" ROUNDS STEPS [extra dec18_step.py flags]
M=$1; CTX=${2:-"4096 8192"}; ROUNDS=${3:-2}; STEPS=${4:-25}; shift 4
cd "$(dirname "$0")/../.." && export PYTHONPATH=$PWD/src
echo "# $(date -u +%FT%TZ) git $(git log --oneline -1 | cut -c1-60) cpu $(lscpu | grep 'Model name' | tr -s ' ' | cut -d: -f2)"
echo "# bash docs/data/dec18_ab.sh $M \"$CTX\" $ROUNDS $STEPS $*"
for r in $(seq 1 $ROUNDS); do
  if (( r % 2 )); then arms="old new"; else arms="new old"; fi
  for arm in $arms; do
    if [ $arm = old ]; then envs="GOMP_SPINCOUNT=300000"; else envs="GOMP_SPINCOUNT=10000"; fi
    echo "## round $r arm $arm ($envs) load $(cut -d' ' -f1-3 /proc/loadavg)"
    env $envs python3 docs/data/dec18_step.py "$M" --context $CTX --steps $STEPS --rounds 1 "$@" 2>&1 | grep '^{' | sed "s/^{/{\"ab\": \"$arm\", /"
  done
done
