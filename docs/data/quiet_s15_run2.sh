#!/bin/bash
cd /work/main
Q=/work/wt/quiet15
S=$(treeattn models --path smollm2); G=$(treeattn models --path gemma3); L=/work/llama/venv/bin/python
stamp() { echo "## $(date -u +%H:%M:%S) load $(cut -d' ' -f1-3 /proc/loadavg) :: $*"; }
{
stamp "w50 smollm2 4k (second run)"; python3 benchmarks/models/weight_format.py "$S" --context 4096 --nproc 1 2 --weight-format packed --kv-cache-dtype float32 float16 --activation-format float32 int8 --llama-python $L --llama-threads 2 --max-new-tokens 16 > $Q/wf_smollm2_4k.txt 2>&1; tail -10 $Q/wf_smollm2_4k.txt
stamp "serve matrix gemma"; python3 benchmarks/serving/serve_matrix.py gemma3 --nproc 1 2 --cells 512:1 512:4 2048:1 512:16 --output-len 32 --min-prompts 2 --prompts-factor 1 --llama-python $L --llama-server-python /work/llama/xvenv/bin/python --llama-parallel 4 --budget-min 7 --out-dir $Q/serve_matrix_gemma3_quiet > $Q/serve_matrix_gemma.log 2>&1; python3 benchmarks/serving/serve_matrix.py --table $Q/serve_matrix_gemma3_quiet; python3 benchmarks/serving/serve_matrix.py --knee $Q/serve_matrix_gemma3_quiet
stamp "helix 4k int8 f16kv"; python3 benchmarks/parallel/helix_layouts.py /tmp/llama1b.Q4_0.gguf --context 4096 --rounds 1 --kv-cache-dtype float16 --activation-format int8 --llama-python $L --output $Q/helix_layouts_4k_int8_f16kv.txt > $Q/helix_4k.log 2>&1; tail -14 $Q/helix_layouts_4k_int8_f16kv.txt
stamp done
} >> $Q/run.log 2>&1
