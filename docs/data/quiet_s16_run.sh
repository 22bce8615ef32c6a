#!/bin/bash
# Session 16's quiet measurements, one at a time, on main after the merges (helpers and RULER stopped), in priority order.
cd /work/main && export PYTHONPATH=/work/main/src
Q=/work/wt/quiet16
S=$(treeattn models --path smollm2); G=$(treeattn models --path gemma3); L=/work/llama/venv/bin/python
stamp() { echo "## $(date -u +%H:%M:%S) load $(cut -d' ' -f1-3 /proc/loadavg) :: $*"; }
{
stamp "lscpu: $(lscpu | grep 'Model name' | tr -s ' ')"
stamp "git $(git log --oneline -1)"
stamp warmup; python3 -m treeattn.ops.warmup >/dev/null 2>&1
stamp "logprobs 8k 1 rank"; python3 benchmarks/engine/prompt_logprobs_overhead.py "$S" --tokens 8000 --nproc 1 --rounds 4 > $Q/logprobs_8k_p1.txt 2>&1; tail -12 $Q/logprobs_8k_p1.txt
stamp "helix 16k int8 f16kv"; python3 benchmarks/parallel/helix_layouts.py /tmp/llama1b.Q4_0.gguf --context 16384 --rounds 1 --layouts tp2 seq one llama --max-new-tokens 64 --kv-cache-dtype float16 --activation-format int8 --llama-python $L --output $Q/helix_layouts_16k_int8_f16kv.txt > $Q/helix_16k.log 2>&1; tail -14 $Q/helix_layouts_16k_int8_f16kv.txt
stamp "w50 smollm2 4k f16 int8"; python3 benchmarks/models/weight_format.py "$S" --context 4096 --nproc 1 2 --weight-format packed --kv-cache-dtype float16 --activation-format int8 --llama-python $L --llama-threads 2 --max-new-tokens 16 > $Q/wf_smollm2_4k.txt 2>&1; tail -10 $Q/wf_smollm2_4k.txt
stamp "w50 gemma 4k f16 int8"; python3 benchmarks/models/weight_format.py "$G" --context 4096 --nproc 1 2 --weight-format packed --kv-cache-dtype float16 --activation-format int8 --llama-python $L --llama-threads 2 --max-new-tokens 16 > $Q/wf_gemma_4k.txt 2>&1; tail -10 $Q/wf_gemma_4k.txt
stamp done
} >> $Q/run.log 2>&1
