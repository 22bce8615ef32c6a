#!/bin/bash
# Session 15's quiet measurements, one at a time, on main after the merges (helpers and RULER stopped), in priority order.
cd /work/main
Q=/work/wt/quiet15
S=$(treeattn models --path smollm2); G=$(treeattn models --path gemma3); L=/work/llama/venv/bin/python
stamp() { echo "## $(date -u +%H:%M:%S) load $(cut -d' ' -f1-3 /proc/loadavg) :: $*"; }
{
stamp "lscpu: $(lscpu | grep 'Model name' | tr -s ' ')"
stamp warmup; python3 -m treeattn.ops.warmup >/dev/null 2>&1
stamp "w50 smollm2 4k"; python3 benchmarks/models/weight_format.py "$S" --context 4096 --nproc 1 2 --weight-format packed --kv-cache-dtype float32 float16 --activation-format float32 int8 --llama-python $L --llama-threads 2 --max-new-tokens 16 > $Q/wf_smollm2_4k.txt 2>&1; tail -14 $Q/wf_smollm2_4k.txt
stamp "w50 gemma 4k"; python3 benchmarks/models/weight_format.py "$G" --context 4096 --nproc 1 2 --weight-format packed --kv-cache-dtype float32 float16 --activation-format float32 int8 --llama-python $L --llama-threads 2 --max-new-tokens 16 > $Q/wf_gemma_4k.txt 2>&1; tail -14 $Q/wf_gemma_4k.txt
stamp "logprobs 8k 1 rank"; python3 benchmarks/engine/prompt_logprobs_overhead.py "$S" --tokens 8000 --nproc 1 --rounds 4 > $Q/logprobs_8k_p1.txt 2>&1; tail -30 $Q/logprobs_8k_p1.txt
stamp "helix 4k int8 f16kv"; python3 benchmarks/parallel/helix_layouts.py /tmp/llama1b.Q4_0.gguf --context 4096 --rounds 1 --kv-cache-dtype float16 --activation-format int8 --llama-python $L --output $Q/helix_layouts_4k_int8_f16kv.txt > $Q/helix_4k.log 2>&1; tail -14 $Q/helix_layouts_4k_int8_f16kv.txt
stamp "serve matrix gemma"; python3 benchmarks/serving/serve_matrix.py gemma3 --nproc 1 2 --cells 512:1 512:4 2048:1 512:16 --output-len 32 --min-prompts 2 --prompts-factor 1 --llama-python $L --llama-server-python /work/llama/xvenv/bin/python --llama-parallel 4 --budget-min 7 --out-dir $Q/serve_matrix_gemma3_quiet > $Q/serve_matrix_gemma.log 2>&1; python3 benchmarks/serving/serve_matrix.py --table $Q/serve_matrix_gemma3_quiet; python3 benchmarks/serving/serve_matrix.py --knee $Q/serve_matrix_gemma3_quiet
stamp done
} > $Q/run.log 2>&1
