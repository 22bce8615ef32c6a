#!/bin/bash
# Session 22's quiet measurements on an Intel Xeon host, one at a time, on main after the merges (helpers stopped).
# Usage: bash docs/data/quiet_s22_run.sh [PART...]
#   parts: table4k smollm2_8k helix4k (default: table4k helix4k)
#   table4k:    issue 50's 4K rows, SmolLM2 and Gemma 3: 1 rank, 2 ranks sequence-only, 2 ranks Helix --tp 1 (int8
#               activations), and the float32 path; llama.cpp 2 threads; 2 rounds alternated inside one run
#               (weight_format.py --repeats 2: every round printed, the fastest of each setting kept)
#   smollm2_8k: issue 50's SmolLM2 8K row, int8, same settings, 1 round
#   helix4k:    issue 47's 4K row (tp2, seq, one, llama), int8, float16 KV
cd /work/main && export PYTHONPATH=/work/main/src
Q=${Q:-/work/main/docs/data/quiet_s22}; mkdir -p $Q
S=$(treeattn models --path smollm2); G=$(treeattn models --path gemma3); L=/work/llama/venv/bin/python
stamp() { echo "## $(date -u +%H:%M:%S) load $(cut -d' ' -f1-3 /proc/loadavg) :: $*"; }
wf() { echo "# python3 benchmarks/models/weight_format.py $* --weight-format packed --kv-cache-dtype float16 --llama-python $L --llama-threads 2 --max-new-tokens 16"
       python3 benchmarks/models/weight_format.py "$@" --weight-format packed --kv-cache-dtype float16 --llama-python $L --llama-threads 2 --max-new-tokens 16; }
parts=${*:-table4k helix4k}
{
stamp "lscpu: $(lscpu | grep 'Model name' | tr -s ' ')"
stamp "git $(git log --oneline -1)"
stamp warmup; python3 -m treeattn.ops.warmup >/dev/null 2>&1
for part in $parts; do case $part in
table4k)
  for M in "$S" "$G"; do n=$(basename "$M" .gguf | cut -c1-7 | tr 'A-Z' 'a-z')
    stamp "w50 $n 4k"; wf "$M" --context 4096 --nproc 1 2 --tp none 1 --activation-format int8 float32 --repeats 2 > $Q/wf_${n}_4k.txt 2>&1; grep -v "^# round" $Q/wf_${n}_4k.txt | tail -9; done ;;
smollm2_8k) stamp "w50 smollm2 8k int8"; wf "$S" --context 8150 --nproc 1 2 --tp none 1 --activation-format int8 > $Q/wf_smollm2_8k.txt 2>&1; tail -6 $Q/wf_smollm2_8k.txt ;;
helix4k) stamp "w47 helix 4k"; python3 benchmarks/parallel/helix_layouts.py /tmp/llama1b.Q4_0.gguf --context 4096 --rounds 1 --layouts tp2 seq one llama --max-new-tokens 64 --kv-cache-dtype float16 --activation-format int8 --llama-python $L --output $Q/helix_layouts_4k.txt > $Q/helix_4k.log 2>&1; tail -20 $Q/helix_4k.log ;;
esac; done
stamp done
} >> $Q/run.log 2>&1
