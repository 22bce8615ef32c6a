#!/bin/bash
# Session 23's quiet measurements on an Intel Xeon host, one at a time, on main after the merges (helpers stopped).
# Usage: Q=<out dir> bash docs/data/quiet_s23_run.sh [PART...]
#   parts: table4k smollm2_8k logprobs (default: table4k smollm2_8k)
#   table4k:    issue 50's 4K rows, SmolLM2 and Gemma 3: 1 rank and 2 ranks sequence-only, int8 and float32
#               activations; llama.cpp 2 threads; 2 rounds alternated inside one run (every round printed), 32 tokens
#   smollm2_8k: issue 50's SmolLM2 8K row, int8, 1 and 2 ranks, 1 round, 32 tokens
#   logprobs:   issue 48's check, 8K prompt, 1 rank, 6 rounds
cd /work/main && export PYTHONPATH=/work/main/src
Q=${Q:-/work/main/docs/data/quiet_s23}; mkdir -p $Q
S=$(treeattn models --path smollm2); G=$(treeattn models --path gemma3); L=/work/llama/venv/bin/python
stamp() { echo "## $(date -u +%H:%M:%S) load $(cut -d' ' -f1-3 /proc/loadavg) :: $*"; }
wf() { echo "# python3 benchmarks/models/weight_format.py $* --weight-format packed --kv-cache-dtype float16 --llama-python $L --llama-threads 2 --max-new-tokens 32"
       python3 benchmarks/models/weight_format.py "$@" --weight-format packed --kv-cache-dtype float16 --llama-python $L --llama-threads 2 --max-new-tokens 32; }
parts=${*:-table4k smollm2_8k}
{
stamp "lscpu: $(lscpu | grep 'Model name' | tr -s ' ')"
stamp "git $(git log --oneline -1)"
stamp warmup; python3 -m treeattn.ops.warmup >/dev/null 2>&1
for part in $parts; do case $part in
table4k)
  for M in "$S" "$G"; do n=$(basename "$M" .gguf | cut -c1-7 | tr 'A-Z' 'a-z')
    stamp "w50 $n 4k"; wf "$M" --context 4096 --nproc 1 2 --activation-format int8 float32 --repeats 2 > $Q/wf_${n}_4k.txt 2>&1; grep "^# round" $Q/wf_${n}_4k.txt; done ;;
smollm2_8k) stamp "w50 smollm2 8k int8"; wf "$S" --context 8150 --nproc 1 2 --activation-format int8 > $Q/wf_smollm2_8k.txt 2>&1; grep "^# round" $Q/wf_smollm2_8k.txt ;;
logprobs) stamp "w48 logprobs 8k"; echo "# python3 benchmarks/engine/prompt_logprobs_overhead.py $S --tokens 8000 --nproc 1 --rounds 6"
  python3 benchmarks/engine/prompt_logprobs_overhead.py "$S" --tokens 8000 --nproc 1 --rounds 6 > $Q/logprobs_8k_p1.txt 2>&1; tail -12 $Q/logprobs_8k_p1.txt ;;
esac; done
stamp done
} >> $Q/run.log 2>&1
