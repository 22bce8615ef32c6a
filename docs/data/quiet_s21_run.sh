#!/bin/bash
# Session 21's quiet measurements on an Intel Xeon host, one at a time, on main after the merges (helpers stopped).
# Usage: bash docs/data/quiet_s21_run.sh [PART...]
#   parts: warmupab table4k8k table logprobs helix4k prefillbf16 helix16k (default: table4k8k helix4k)
#   warmupab:  the install's numba warm-up from an empty cache, 1 process against 2 (--jobs), alternated twice
#   table4k8k: issue 50's table without its 30K row: SmolLM2 4K and Gemma 3 4K (int8 and float32), SmolLM2 8K (int8),
#              1 and 2 ranks, float16 KV, vs llama.cpp 2 threads
#   table:     issue 50's table in one run on this host: SmolLM2 4K (int8 and float32), Gemma 3 4K (int8 and float32),
#              SmolLM2 8K (int8), Gemma 3 30K (int8), 1 and 2 ranks, float16 KV, vs llama.cpp 2 threads
#   logprobs:  issue 48's goal, an 8K prompt's logprobs against its prefill, 1 rank, 6 rounds
#   helix4k:   issue 47's 4K row (tp2, seq, one, llama), int8, float16 KV
#   prefillbf16: SmolLM2 and Gemma 3 4K, 1 rank, int8, prefill float32 vs bfloat16 (AMX through oneDNN)
#   helix16k:  issue 47's 16K row
cd /work/main && export PYTHONPATH=/work/main/src
Q=${Q:-/work/main/docs/data/quiet_s21}; mkdir -p $Q
S=$(treeattn models --path smollm2); G=$(treeattn models --path gemma3); L=/work/llama/venv/bin/python
stamp() { echo "## $(date -u +%H:%M:%S) load $(cut -d' ' -f1-3 /proc/loadavg) :: $*"; }
wf() { python3 benchmarks/models/weight_format.py "$@" --weight-format packed --kv-cache-dtype float16 --llama-python $L --llama-threads 2 --max-new-tokens 16; }
parts=${*:-table4k8k helix4k}
{
stamp "lscpu: $(lscpu | grep 'Model name' | tr -s ' ')"
stamp "git $(git log --oneline -1)"
stamp warmup; python3 -m treeattn.ops.warmup >/dev/null 2>&1
for part in $parts; do case $part in
warmupab)
  for jobs in 1 2 1 2; do rm -f src/treeattn/*/__pycache__/*.nbi src/treeattn/*/__pycache__/*.nbc
    stamp "warm-up from an empty numba cache, --jobs $jobs"; /usr/bin/time -f "%e s wall, %U s user, %S s sys" python3 -m treeattn.ops.warmup --jobs $jobs 2>&1 | tee -a $Q/warmup_jobs_ab.txt; done ;;
table4k8k)
  stamp "w50 smollm2 4k int8+float32"; wf "$S" --context 4096 --nproc 1 2 --activation-format int8 float32 > $Q/wf_smollm2_4k.txt 2>&1; tail -8 $Q/wf_smollm2_4k.txt
  stamp "w50 gemma 4k int8+float32"; wf "$G" --context 4096 --nproc 1 2 --activation-format int8 float32 > $Q/wf_gemma_4k.txt 2>&1; tail -8 $Q/wf_gemma_4k.txt
  stamp "w50 smollm2 8k int8"; wf "$S" --context 8150 --nproc 1 2 --activation-format int8 > $Q/wf_smollm2_8k.txt 2>&1; tail -6 $Q/wf_smollm2_8k.txt ;;
table)
  stamp "w50 smollm2 4k int8+float32"; wf "$S" --context 4096 --nproc 1 2 --activation-format int8 float32 > $Q/wf_smollm2_4k.txt 2>&1; tail -8 $Q/wf_smollm2_4k.txt
  stamp "w50 gemma 4k int8+float32"; wf "$G" --context 4096 --nproc 1 2 --activation-format int8 float32 > $Q/wf_gemma_4k.txt 2>&1; tail -8 $Q/wf_gemma_4k.txt
  stamp "w50 smollm2 8k int8"; wf "$S" --context 8150 --nproc 1 2 --activation-format int8 > $Q/wf_smollm2_8k.txt 2>&1; tail -6 $Q/wf_smollm2_8k.txt
  stamp "w50 gemma 30k int8"; wf "$G" --context 30000 --nproc 1 2 --activation-format int8 > $Q/wf_gemma_30k.txt 2>&1; tail -6 $Q/wf_gemma_30k.txt ;;
logprobs) stamp "logprobs 8k 1 rank"; python3 benchmarks/engine/prompt_logprobs_overhead.py "$S" --tokens 8000 --nproc 1 --rounds 6 > $Q/logprobs_8k_p1.txt 2>&1; tail -14 $Q/logprobs_8k_p1.txt ;;
prefillbf16) for M in "$G" "$S"; do n=$(basename "$M" .gguf); stamp "prefill float32 vs bfloat16 (AMX) $n"; python3 benchmarks/models/prefill_ab.py "$M" --baseline-src src --src src --prefill-dtype bfloat16 --activation-format int8 --context 4096 --nproc 1 --repeats 2 --output $Q/prefill_bf16_$n.jsonl > $Q/prefill_bf16_$n.txt 2>&1; tail -6 $Q/prefill_bf16_$n.txt; done ;;
helix4k) stamp "w47 helix 4k"; python3 benchmarks/parallel/helix_layouts.py /tmp/llama1b.Q4_0.gguf --context 4096 --rounds 1 --layouts tp2 seq one llama --max-new-tokens 64 --kv-cache-dtype float16 --activation-format int8 --llama-python $L --output $Q/helix_layouts_4k.txt > $Q/helix_4k.log 2>&1; tail -20 $Q/helix_4k.log ;;
helix16k) stamp "w47 helix 16k"; python3 benchmarks/parallel/helix_layouts.py /tmp/llama1b.Q4_0.gguf --context 16384 --rounds 1 --layouts tp2 seq one llama --max-new-tokens 64 --kv-cache-dtype float16 --activation-format int8 --llama-python $L --output $Q/helix_layouts_16k.txt > $Q/helix_16k.log 2>&1; tail -20 $Q/helix_16k.log ;;
esac; done
stamp done
} >> $Q/run.log 2>&1
