#!/bin/bash
# 2-rank SmolLM2 4K int8: main against f34aec7 (session 18's main), alternated, each tree's own weight_format.py.
Q=/work/wt/quiet19; S=$(treeattn models --path smollm2)
stamp() { echo "## $(date -u +%H:%M:%S) load $(cut -d' ' -f1-3 /proc/loadavg) :: $*"; }
run() { (cd $1 && PYTHONPATH=$1/src python3 benchmarks/models/weight_format.py "$S" --context 4096 --nproc 2 --weight-format packed --kv-cache-dtype float16 --activation-format int8 --max-new-tokens 16 2>&1 | grep setting); }
{
stamp "warm f34 (numba cache of that tree)"; run /tmp/f34 >/dev/null
for r in 1 2 3; do
  if [ $((r % 2)) = 1 ]; then order="/work/main /tmp/f34"; else order="/tmp/f34 /work/main"; fi
  for t in $order; do stamp "round $r $t"; run $t; done
done
stamp done
} > $Q/ab2_smollm2_4k_2ranks.txt 2>&1
