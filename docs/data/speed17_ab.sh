#!/bin/bash
# Session 17 (speed17), UNDER LOAD: decode CPU time per token, base (3c78e02, speed17's base) against speed17's branch,
# alternated one process at a time: Gemma 3 270M (or MODEL) at CONTEXT tokens, float16 KV, int8 activations, 1 and 2 ranks.
# Usage: bash docs/data/speed17_ab.sh MODEL CONTEXT ROUNDS "NPROCS" > docs/data/speed17_ab_<model>_<context>.txt
set -e
MODEL=${1:?MODEL}; CONTEXT=${2:-4080}; ROUNDS=${3:-1}; NPROCS=${4:-1 2}
cd "$(dirname "$0")/../.."
BASE=/tmp/speed17_base_3c78e02
[ -d $BASE/src ] || { mkdir -p $BASE && git archive 3c78e02 src | tar -x -C $BASE; }
for round in $(seq $ROUNDS); do
  for nproc in $NPROCS; do
    PYTHONPATH=$BASE/src python docs/data/speed17_ab_run.py $MODEL $CONTEXT $nproc 24 int8 base
    PYTHONPATH=$PWD/src python docs/data/speed17_ab_run.py $MODEL $CONTEXT $nproc 24 int8 speed17
  done
done
