#!/bin/bash
cd /work/main
Q=/work/wt/quiet15; L=/work/llama/venv/bin/python
stamp() { echo "## $(date -u +%H:%M:%S) load $(cut -d' ' -f1-3 /proc/loadavg) :: $*"; }
{
stamp "serve gemma 4 ranks short"; python3 benchmarks/serving/serve_matrix.py gemma3 --nproc 4 --cells 512:1 2048:1 --output-len 32 --min-prompts 2 --prompts-factor 1 --budget-min 4 --out-dir $Q/serve_matrix_gemma3_quiet_p4 > $Q/serve_matrix_gemma_p4.log 2>&1; python3 benchmarks/serving/serve_matrix.py --table $Q/serve_matrix_gemma3_quiet_p4
stamp "serve gemma 8000"; python3 benchmarks/serving/serve_matrix.py gemma3 --nproc 1 2 4 --cells 8000:1 --output-len 32 --min-prompts 2 --prompts-factor 1 --llama-python $L --budget-min 8 --out-dir $Q/serve_matrix_gemma3_quiet_8k > $Q/serve_matrix_gemma_8k.log 2>&1; python3 benchmarks/serving/serve_matrix.py --table $Q/serve_matrix_gemma3_quiet_8k
stamp done
} >> $Q/run.log 2>&1
