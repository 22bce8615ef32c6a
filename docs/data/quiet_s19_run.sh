#!/bin/bash
# Session 19's quiet measurements, one at a time, on main after the merges (helpers stopped), in priority order.
# Usage: bash docs/data/quiet_s19_run.sh [PART...]
#   parts: release table logprobs prefill kshare helix16k (default: all, in this order)
#   release:  dec19's A/B (the building thread's OpenMP pool kept vs released), SmolLM2 4K, 1 rank, int8
#   table:    issue 50's table in one run: SmolLM2 4K and 8K, Gemma 3 4K and 30K, 1 and 2 ranks, vs llama.cpp
#   logprobs: issue 48's goal, an 8K prompt's logprobs against its prefill, 1 rank, 6 rounds
#   prefill:  main's src against /tmp/base19/src (main with ops/packed_linear.py's float32 prefill product back on
#             F.linear, MKL), Gemma 3 then SmolLM2 at 4K, 1 rank
#   kshare:   kern19's kernel shares of Llama-3.2-1B's 16K attention per layout, 1 and 2 threads
#   helix16k: issue 47's 16K row
cd /work/main && export PYTHONPATH=/work/main/src
Q=/work/wt/quiet19; mkdir -p $Q
S=$(treeattn models --path smollm2); G=$(treeattn models --path gemma3); L=/work/llama/venv/bin/python
stamp() { echo "## $(date -u +%H:%M:%S) load $(cut -d' ' -f1-3 /proc/loadavg) :: $*"; }
wf() { python3 benchmarks/models/weight_format.py "$@" --weight-format packed --kv-cache-dtype float16 --llama-python $L --llama-threads 2 --max-new-tokens 16; }
parts=${*:-release table logprobs prefill kshare helix16k}
{
stamp "lscpu: $(lscpu | grep 'Model name' | tr -s ' ')"
stamp "git $(git log --oneline -1)"
stamp warmup; python3 -m treeattn.ops.warmup >/dev/null 2>&1
for part in $parts; do case $part in
release) stamp "dec19 release A/B int8"; python3 docs/data/dec19_steps.py "$S" --ab release --rounds 4 --activation-format int8 > $Q/dec19_release_ab_int8.txt 2>&1; tail -12 $Q/dec19_release_ab_int8.txt ;;
table)
  stamp "w50 smollm2 4k int8+float32"; wf "$S" --context 4096 --nproc 1 2 --activation-format int8 float32 > $Q/wf_smollm2_4k.txt 2>&1; tail -12 $Q/wf_smollm2_4k.txt
  stamp "w50 gemma 4k int8+float32"; wf "$G" --context 4096 --nproc 1 2 --activation-format int8 float32 > $Q/wf_gemma_4k.txt 2>&1; tail -12 $Q/wf_gemma_4k.txt
  stamp "w50 smollm2 8k int8"; wf "$S" --context 8150 --nproc 1 2 --activation-format int8 > $Q/wf_smollm2_8k.txt 2>&1; tail -12 $Q/wf_smollm2_8k.txt
  stamp "w50 gemma 30k int8"; wf "$G" --context 30000 --nproc 1 2 --activation-format int8 > $Q/wf_gemma_30k.txt 2>&1; tail -12 $Q/wf_gemma_30k.txt ;;
logprobs) stamp "logprobs 8k 1 rank"; python3 benchmarks/engine/prompt_logprobs_overhead.py "$S" --tokens 8000 --nproc 1 --rounds 6 > $Q/logprobs_8k_p1.txt 2>&1; tail -14 $Q/logprobs_8k_p1.txt ;;
prefill) for M in "$G" "$S"; do n=$(basename "$M" .gguf); stamp "prefill A/B oneDNN vs MKL $n"; python3 benchmarks/models/prefill_ab.py "$M" --baseline-src /tmp/base19/src --src src --context 4096 --nproc 1 --repeats 2 --output $Q/prefill_ab_onednn_$n.jsonl > $Q/prefill_ab_$n.txt 2>&1; tail -6 $Q/prefill_ab_$n.txt; done ;;
kshare) stamp "kern19 shares"; python3 benchmarks/kernels/helix_attention_share.py --context 8192 16384 --threads 1 2 --dtypes float16 fp8_e4m3 --repeats 5 --roof-bytes 268435456 --output $Q/kern19_share_quiet.txt > $Q/kshare.log 2>&1; tail -20 $Q/kshare.log ;;
helix16k) stamp "w47 helix 16k"; python3 benchmarks/parallel/helix_layouts.py /tmp/llama1b.Q4_0.gguf --context 16384 --rounds 1 --layouts tp2 seq one llama --max-new-tokens 64 --kv-cache-dtype float16 --activation-format int8 --llama-python $L --output $Q/helix_layouts_16k.txt > $Q/helix_16k.log 2>&1; tail -20 $Q/helix_16k.log ;;
esac; done
stamp done
} >> $Q/run.log 2>&1
