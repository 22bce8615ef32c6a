#!/bin/bash
# main (A) and this branch (B) alternated, ABAB: weight_format.py, 2 ranks (sequence-only), int8, float16 KV, 4K, 32 tokens,
# no llama.cpp; wall-clock ms a token as the script reports it. usage: wf_2ranks_ab.sh MAIN_SRC BRANCH_SRC MODEL ROUNDS
MAIN=$1; BRANCH=$2; MODEL=$3; ROUNDS=${4:-2}
for round in $(seq "$ROUNDS"); do
  for side in A B; do
    src=$MAIN; [ "$side" = B ] && src=$BRANCH
    echo "{\"side\": \"$side\", \"round\": $round, \"src\": \"$src\", \"uptime\": \"$(uptime)\"}"
    ps aux --sort=-%cpu | head -4 | cut -c1-160 | sed "s/^/# /"
    PYTHONPATH=$src python3 benchmarks/models/weight_format.py "$MODEL" --context 4096 --nproc 2 --activation-format int8 \
      --repeats 1 --weight-format packed --kv-cache-dtype float16 --max-new-tokens 32
  done
done
