# dec21: issue 50's 1-rank cells with this branch, under load (other helpers' CI and benchmarks on the same 2 cores);
# SmolLM2 8K as --context 8150 (8,140 tokens, session 20's prompt length: --context 8192 now builds 8,177, which the CLI
# refuses with 16 new tokens).
S=$(PYTHONPATH=/work/wt/dec21/src treeattn models --path smollm2); G=$(PYTHONPATH=/work/wt/dec21/src treeattn models --path gemma3)
for cell in "$S 8150" "$G 4096" "$S 4096"; do set -- $cell
  echo "## $(basename $1) --context $2, load $(cut -d' ' -f1-3 /proc/loadavg), $(date -u +%T)"
  PYTHONPATH=/work/wt/dec21/src python3 /work/wt/dec21/benchmarks/models/weight_format.py $1 --context $2 --nproc 1 \
    --weight-format packed --kv-cache-dtype float16 --activation-format int8 --llama-python /work/llama/venv/bin/python \
    --llama-threads 2 --max-new-tokens 16 2>&1 | grep -v "^WARNING"
done
echo "# done, load $(cat /proc/loadavg), $(date -u +%T)"
