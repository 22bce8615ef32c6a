#!/bin/bash
# A/B, alternated: main (/work/main/src) vs this branch (tp22), the Helix layout --tp 1 on 2 ranks, and the
# sequence-only layout and one process of 2 threads for reference, at 4K, int8 activations, float16 KV.
# Run from /work/wt/tp22:  bash docs/data/tp22/ab_run.sh
# "main" here: /work/main/src at 429f0df (its src differs from this branch's parent 4b01877 in ops/warmup.py only).
# Separate runs drifted 1.4x on identical pieces (docs/helix.md, "Session 22"): oproj_ab_run.sh is the A/B that counts.
set -u
OUT=docs/data/tp22
S=$(PYTHONPATH=$PWD/src treeattn models --path smollm2)
G=$(PYTHONPATH=$PWD/src treeattn models --path gemma3)
run() {  # name src model layouts...
  local name=$1 src=$2 model=$3; shift 3
  echo "== $(date -u +%H:%M:%S) $name load $(cut -d' ' -f1-3 /proc/loadavg)" >> $OUT/ab_run.log
  PYTHONPATH=$src python3 benchmarks/parallel/step_pieces.py $model --context 4096 --max-new-tokens 16 --warmup 3 \
    --layouts "$@" --label $name --output $OUT/$name.jsonl >> $OUT/ab_run.log 2>&1
}
for r in 1 2; do
  if [ $r = 1 ]; then A=main; B=tp22; else A=tp22; B=main; fi
  for m in smollm2 gemma; do
    M=$S; [ $m = gemma ] && M=$G
    for side in $A $B; do
      src=/work/main/src; [ $side = tp22 ] && src=$PWD/src
      run ${m}_tp1_${side}_r$r $src $M tp1
    done
  done
done
for m in smollm2 gemma; do
  M=$S; [ $m = gemma ] && M=$G
  run ${m}_seq_one_tp22 $PWD/src $M seq one
done
echo "== $(date -u +%H:%M:%S) done load $(cut -d' ' -f1-3 /proc/loadavg)" >> $OUT/ab_run.log
