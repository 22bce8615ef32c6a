#!/bin/bash
# Session 24's quiet measurements on an Intel Xeon host, one at a time, on main after the merges (helpers stopped).
# Usage: Q=<out dir> bash docs/data/quiet_s24_run.sh [PART...]
#   parts: gemma4k logprobs kernels smollm2_4k gemma30k (default: gemma4k logprobs kernels)
#   gemma4k:    issue 50's Gemma 3 4K rows: 1 rank and 2 ranks sequence-only, int8 and float32 activations;
#               llama.cpp 2 threads; 2 rounds alternated inside one run (every round printed), 32 tokens
#   logprobs:   issue 48's check, 8K prompt, 1 rank, 6 rounds
#   kernels:    the paged kernel on 1 and 2 threads at short contexts; sampling's cost (session 24's changes)
#   smollm2_4k: SmolLM2 4K, int8, 1 rank, 2 ranks sequence-only and 2 ranks --tp 1 (the demo's layout), 1 round
#   gemma30k:   Gemma 3 30K, int8, 1 and 2 ranks, 1 round, 16 tokens (~15 minutes: llama.cpp's prefill alone ~6)
#   smollm2_8k: SmolLM2 8K, int8, 1 and 2 ranks, 1 round, 32 tokens
#   smollm2_4k_f32: SmolLM2 4K, float32 activations (the exact path), 1 and 2 ranks, 1 round, 32 tokens
cd /work/main && export PYTHONPATH=/work/main/src
Q=${Q:-/work/main/docs/data/quiet_s24}; mkdir -p $Q
S=$(treeattn models --path smollm2); G=$(treeattn models --path gemma3); L=/work/llama/venv/bin/python
stamp() { echo "## $(date -u +%H:%M:%S) load $(cut -d' ' -f1-3 /proc/loadavg) :: $*"; }
wf() { echo "# python3 benchmarks/models/weight_format.py $* --weight-format packed --kv-cache-dtype float16 --llama-python $L --llama-threads 2"
       python3 benchmarks/models/weight_format.py "$@" --weight-format packed --kv-cache-dtype float16 --llama-python $L --llama-threads 2; }
parts=${*:-gemma4k logprobs kernels}
{
stamp "lscpu: $(lscpu | grep 'Model name' | tr -s ' ')"
stamp "git $(git log --oneline -1)"
stamp warmup; python3 -m treeattn.ops.warmup >/dev/null 2>&1
for part in $parts; do case $part in
gemma4k) stamp "w50 gemma 4k"; wf "$G" --context 4096 --nproc 1 2 --activation-format int8 float32 --repeats 2 --max-new-tokens 32 > $Q/wf_gemma_4k.txt 2>&1; grep "^# round" $Q/wf_gemma_4k.txt ;;
smollm2_4k) stamp "w50 smollm2 4k int8"; wf "$S" --context 4096 --nproc 1 2 --tp none 1 --activation-format int8 --max-new-tokens 32 > $Q/wf_smollm2_4k.txt 2>&1; grep "^# round" $Q/wf_smollm2_4k.txt ;;
smollm2_4k_f32) stamp "w50 smollm2 4k float32"; wf "$S" --context 4096 --nproc 1 2 --activation-format float32 --max-new-tokens 32 > $Q/wf_smollm2_4k_f32.txt 2>&1 ;;
smollm2_8k) stamp "w50 smollm2 8k int8"; wf "$S" --context 8150 --nproc 1 2 --activation-format int8 --max-new-tokens 32 > $Q/wf_smollm2_8k.txt 2>&1; grep "^# round" $Q/wf_smollm2_8k.txt ;;
gemma30k) stamp "w50 gemma 30k int8"; wf "$G" --context 30000 --nproc 1 2 --activation-format int8 --max-new-tokens 16 > $Q/wf_gemma_30k.txt 2>&1; grep "^# round" $Q/wf_gemma_30k.txt ;;
logprobs) stamp "w48 logprobs 8k"; echo "# python3 benchmarks/engine/prompt_logprobs_overhead.py $S --tokens 8000 --nproc 1 --rounds 6"
  python3 benchmarks/engine/prompt_logprobs_overhead.py "$S" --tokens 8000 --nproc 1 --rounds 6 > $Q/logprobs_8k_p1.txt 2>&1; tail -12 $Q/logprobs_8k_p1.txt ;;
kernels) stamp "paged kernel threads"; (echo "# python3 benchmarks/kernels/paged_kernel_threads.py --rounds 3 (quiet)"; python3 benchmarks/kernels/paged_kernel_threads.py --rounds 3) > $Q/paged_kernel_threads.txt 2>&1
  stamp "sampling cost"; (echo "# python3 benchmarks/engine/sampling_cost.py (quiet)"; python3 benchmarks/engine/sampling_cost.py) > $Q/sampling_cost.txt 2>&1
  stamp "rank first kernel"; (echo "# python3 benchmarks/parallel/rank_first_kernel.py --repeats 3 (quiet)"; python3 benchmarks/parallel/rank_first_kernel.py --repeats 3) > $Q/rank_first_kernel.txt 2>&1 ;;
esac; done
stamp done
} >> $Q/run.log 2>&1
rm -f /work/wt/QUIET
