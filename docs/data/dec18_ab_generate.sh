#!/bin/bash
# Session 18 (dec18): end to end, `treeattn generate` on 1 rank through benchmarks/models/weight_format.py, alternated
# between libgomp's default spin (GOMP_SPINCOUNT=300000) and 10000 spins (the raw file's 'new' arm: set by a since-removed
# treeattn.openmp at 'import treeattn', the same setting).
#   bash docs/data/dec18_ab_generate.sh MODEL CONTEXT ROUNDS [ACTIVATIONS]
M=$1; CTX=${2:-4096}; ROUNDS=${3:-2}; ACT=${4:-int8}
cd "$(dirname "$0")/../.." && export PYTHONPATH=$PWD/src
echo "# $(date -u +%FT%TZ) git $(git log --oneline -1 | cut -c1-60) cpu $(lscpu | grep 'Model name' | tr -s ' ' | cut -d: -f2)"
echo "# bash docs/data/dec18_ab_generate.sh $M $CTX $ROUNDS $ACT"
for r in $(seq 1 $ROUNDS); do
  if (( r % 2 )); then arms="old new"; else arms="new old"; fi
  for arm in $arms; do
    if [ $arm = old ]; then envs="GOMP_SPINCOUNT=300000"; else envs="GOMP_SPINCOUNT=10000"; fi
    echo "## round $r arm $arm ($envs) $(date -u +%T) load $(cut -d' ' -f1-3 /proc/loadavg)"
    env $envs python3 benchmarks/models/weight_format.py "$M" --context $CTX --nproc 1 --weight-format packed \
      --kv-cache-dtype float16 --activation-format $ACT --max-new-tokens 16 2>&1 | grep '^{' | sed "s/^{/{\"ab\": \"$arm\", /"
  done
done
