#!/bin/bash
# o_proj whole (this branch) vs split over the 2 ranks (before), alternated step by step inside one engine run,
# --tp 1 on 2 ranks, 4K, int8 activations, float16 KV. Run from /work/wt/tp22:  bash docs/data/tp22/oproj_ab_run.sh
set -u
OUT=docs/data/tp22
export PYTHONPATH=$PWD/src
S=$(treeattn models --path smollm2)
G=$(treeattn models --path gemma3)
for r in ${ROUNDS:-1 2}; do
  for m in ${MODELS:-smollm2 gemma}; do
    M=$S; [ $m = gemma ] && M=$G
    echo "== $(date -u +%H:%M:%S) $m r$r load $(cut -d' ' -f1-3 /proc/loadavg)" >> $OUT/oproj_ab_run.log
    python3 benchmarks/parallel/oproj_ab.py $M --context 4096 --max-new-tokens 64 --warmup 4 \
      --output $OUT/oproj_ab_${m}_r$r.txt >> $OUT/oproj_ab_run.log 2>&1
  done
done
echo "== $(date -u +%H:%M:%S) done load $(cut -d' ' -f1-3 /proc/loadavg)" >> $OUT/oproj_ab_run.log
