#!/bin/bash
# main (A) and this branch (B) alternated, ABAB: one rank, ONE torch thread, thread CPU a decode step
# (benchmarks/engine/step_cpu_profile.py of this branch for both; PYTHONPATH picks the checkout's src).
# (copied from docs/data/fuse23/ab_step_cpu.sh)
# usage: docs/data/gemma24/ab_step_cpu.sh MAIN_SRC BRANCH_SRC MODEL MODE ROUNDS ACT KV CONTEXT > out.jsonl
MAIN=$1; BRANCH=$2; MODEL=$3; MODE=$4; ROUNDS=${5:-2}; ACT=${6:-int8}; KV=${7:-float16}; CONTEXT=${8:-4096}
for round in $(seq "$ROUNDS"); do
  for side in A B; do
    src=$MAIN; [ "$side" = B ] && src=$BRANCH
    echo "{\"side\": \"$side\", \"round\": $round, \"src\": \"$src\", \"uptime\": \"$(uptime)\"}"
    ps aux --sort=-%cpu | head -4 | cut -c1-160 | sed "s/^/# /"
    PYTHONPATH=$src python3 benchmarks/engine/step_cpu_profile.py "$MODEL" --context "$CONTEXT" --steps 24 --mode "$MODE" \
      --activation-format "$ACT" --kv-cache-dtype "$KV"
  done
done
