#!/bin/bash
# Session 17's quiet measurements, part 2 (after CI): SmolLM2 at 8K (--context 8150), then Gemma 3 at 30K on 2 ranks.
cd /work/main && export PYTHONPATH=/work/main/src
Q=/work/wt/quiet17
S=$(treeattn models --path smollm2); G=$(treeattn models --path gemma3); L=/work/llama/venv/bin/python
stamp() { echo "## $(date -u +%H:%M:%S) load $(cut -d' ' -f1-3 /proc/loadavg) :: $*"; }
wf() { python3 benchmarks/models/weight_format.py "$@" --weight-format packed --kv-cache-dtype float16 --activation-format int8 --llama-python $L --llama-threads 2 --max-new-tokens 16; }
{
stamp "git $(git log --oneline -1)"
stamp "w50 smollm2 8k"; wf "$S" --context 8150 --nproc 1 2 > $Q/wf_smollm2_8k.txt 2>&1; tail -6 $Q/wf_smollm2_8k.txt
stamp "w50 gemma 30k 2 ranks"; wf "$G" --context 30000 --nproc 2 > $Q/wf_gemma_30k.txt 2>&1; tail -6 $Q/wf_gemma_30k.txt
stamp done
} >> $Q/run2.log 2>&1
