#!/bin/bash
# ABAB: main vs tp24 (the Helix layout's compiled segments), SmolLM2 4K, 2 ranks --tp 1 (treeattn demo's default layout)
# (SmolLM2's 9 query heads refuse --tp 2), int8 activations, float16 KV, 32 tokens, one round of each per side per repeat.
# usage: bash docs/data/tp24/ab_helix_smollm2_4k.sh > docs/data/tp24/ab_helix_smollm2_4k.txt
S=$(treeattn models --path smollm2)
for r in 1 2; do for side in main tp24; do
  src=/work/main/src; [ $side = tp24 ] && src=/work/wt/tp24/src
  echo "## round $r $side $(date -u +%H:%M:%S) load $(cut -d' ' -f1-3 /proc/loadavg)"
  PYTHONPATH=$src python3 /work/main/benchmarks/models/weight_format.py "$S" --context 4096 --nproc 2 --tp 1 \
    --activation-format int8 --weight-format packed --kv-cache-dtype float16 --max-new-tokens 32 2>&1 | grep -E "treeattn|tokens|^#" | head -12
done; done
