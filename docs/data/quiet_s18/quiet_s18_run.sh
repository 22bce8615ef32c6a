#!/bin/bash
# Session 18's quiet measurements, one at a time, on main after the merges (helpers and CI stopped), in priority order.
cd /work/main && export PYTHONPATH=/work/main/src
Q=/work/wt/quiet18; mkdir -p $Q
S=$(treeattn models --path smollm2); G=$(treeattn models --path gemma3); L=/work/llama/venv/bin/python
stamp() { echo "## $(date -u +%H:%M:%S) load $(cut -d' ' -f1-3 /proc/loadavg) :: $*"; }
wf() { python3 benchmarks/models/weight_format.py "$@" --weight-format packed --kv-cache-dtype float16 --llama-python $L --llama-threads 2 --max-new-tokens 16; }
{
stamp "lscpu: $(lscpu | grep 'Model name' | tr -s ' ')"
stamp "git $(git log --oneline -1)"
stamp warmup; python3 -m treeattn.ops.warmup >/dev/null 2>&1
stamp "logprobs 8k 1 rank"; python3 benchmarks/engine/prompt_logprobs_overhead.py "$S" --tokens 8000 --nproc 1 --rounds 4 > $Q/logprobs_8k_p1.txt 2>&1; tail -12 $Q/logprobs_8k_p1.txt
stamp "logprobs engine A/B vs 21a9836"; python3 benchmarks/engine/prompt_logprobs_engine_ab.py "$S" --baseline 21a9836 --context 8000 --repeats 2 --output $Q/logprobs_engine_ab.jsonl > $Q/logprobs_engine_ab.txt 2>&1; tail -12 $Q/logprobs_engine_ab.txt
stamp "w50 smollm2 4k int8+float32"; wf "$S" --context 4096 --nproc 1 2 --activation-format int8 float32 > $Q/wf_smollm2_4k.txt 2>&1; tail -12 $Q/wf_smollm2_4k.txt
stamp "w50 gemma 4k int8+float32"; wf "$G" --context 4096 --nproc 1 2 --activation-format int8 float32 > $Q/wf_gemma_4k.txt 2>&1; tail -12 $Q/wf_gemma_4k.txt
stamp "splits A/B"; python3 docs/data/dec18_step.py "$S" --context 4096 8192 --steps 60 --rounds 6 --ab splits --split > $Q/splits_ab.txt 2>&1; tail -12 $Q/splits_ab.txt
stamp "bf16 prefill A/B gemma"; python3 benchmarks/models/prefill_ab.py "$G" --baseline-src src --src src --prefill-dtype bfloat16 --context 4096 --nproc 1 --repeats 2 --output $Q/bf18_prefill_ab_gemma3_4k.jsonl > $Q/bf18_gemma.txt 2>&1; tail -6 $Q/bf18_gemma.txt
stamp done
} >> $Q/run.log 2>&1
