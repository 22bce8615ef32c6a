#!/bin/bash
# Session 17 (samp17), UNDER LOAD: decode CPU time per token on 2 ranks, main at a6bc8a7 (samp17's base: the logits'
# all-gather every step) against samp17's branch (the greedy fast path), alternated one process at a time.
# Usage: bash docs/data/samp17_ab.sh MODEL CONTEXT ROUNDS TOKENS > docs/data/samp17_ab_gemma3_4k_2ranks.txt
set -e
MODEL=${1:?MODEL}; CONTEXT=${2:-4080}; ROUNDS=${3:-2}; TOKENS=${4:-48}
cd "$(dirname "$0")/../.."
BASE=/tmp/samp17_base_a6bc8a7
[ -d $BASE/src ] || { mkdir -p $BASE && git archive a6bc8a7 src | tar -x -C $BASE; }
for round in $(seq $ROUNDS); do
  PYTHONPATH=$BASE/src python3 docs/data/samp17_ab_run.py $MODEL $CONTEXT 2 $TOKENS base
  PYTHONPATH=$PWD/src python3 docs/data/samp17_ab_run.py $MODEL $CONTEXT 2 $TOKENS samp17
done
