#!/bin/bash
# Session 17's quiet measurements, one at a time, on main after the merges (helpers, CI and RULER stopped), in priority order.
cd /work/main && export PYTHONPATH=/work/main/src
Q=/work/wt/quiet17
S=$(treeattn models --path smollm2); G=$(treeattn models --path gemma3); L=/work/llama/venv/bin/python
stamp() { echo "## $(date -u +%H:%M:%S) load $(cut -d' ' -f1-3 /proc/loadavg) :: $*"; }
wf() { python3 benchmarks/models/weight_format.py "$@" --weight-format packed --kv-cache-dtype float16 --activation-format int8 --llama-python $L --llama-threads 2 --max-new-tokens 16; }
{
stamp "lscpu: $(lscpu | grep 'Model name' | tr -s ' ')"
stamp "git $(git log --oneline -1)"
stamp warmup; python3 -m treeattn.ops.warmup >/dev/null 2>&1
stamp "logprobs 8k 1 rank"; python3 benchmarks/engine/prompt_logprobs_overhead.py "$S" --tokens 8000 --nproc 1 --rounds 4 > $Q/logprobs_8k_p1.txt 2>&1; tail -12 $Q/logprobs_8k_p1.txt
stamp "w50 smollm2 4k"; wf "$S" --context 4096 --nproc 1 2 > $Q/wf_smollm2_4k.txt 2>&1; tail -6 $Q/wf_smollm2_4k.txt
stamp "w50 gemma 4k"; wf "$G" --context 4096 --nproc 1 2 > $Q/wf_gemma_4k.txt 2>&1; tail -6 $Q/wf_gemma_4k.txt
git show 3c78e02:src/treeattn/ops/paged_cpu_kernel.py > /tmp/main_kernel_3c78e02.py
stamp "kernel roof f16"; python3 benchmarks/kernels/paged_kernel_roof.py --heads llama3.2-1b gemma3-270m smollm2 --context 4096 16384 --dtypes float16 --repeats 7 --baseline /tmp/main_kernel_3c78e02.py --output $Q/roof_f16.json > $Q/roof_f16.txt 2>&1; tail -30 $Q/roof_f16.txt
stamp "w50 smollm2 8k"; wf "$S" --context 8192 --nproc 1 2 > $Q/wf_smollm2_8k.txt 2>&1; tail -6 $Q/wf_smollm2_8k.txt
stamp "helix 4k"; python3 benchmarks/parallel/helix_layouts.py /tmp/llama1b.Q4_0.gguf --context 4096 --rounds 1 --layouts tp2 seq one llama --kv-cache-dtype float16 --activation-format int8 --llama-python $L --output $Q/helix_layouts_4k.txt > $Q/helix_4k.log 2>&1; tail -14 $Q/helix_layouts_4k.txt
stamp "w50 gemma 30k 2 ranks"; wf "$G" --context 30000 --nproc 2 > $Q/wf_gemma_30k.txt 2>&1; tail -6 $Q/wf_gemma_30k.txt
stamp done
} >> $Q/run.log 2>&1
