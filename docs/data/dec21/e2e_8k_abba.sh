# dec21: main (git archive of main 3e3694a's src in /tmp/dec21_main) and this branch alternated A B B A, SmolLM2 at
# --context 8150 (8,140 tokens), 1 rank, the settings, no llama.cpp; started when the load fell to ~1.5.
S=$(PYTHONPATH=/work/wt/dec21/src treeattn models --path smollm2)
run() {  # $1 label, $2 src
  echo "## $1, load $(cut -d' ' -f1-3 /proc/loadavg), $(date -u +%T)"
  PYTHONPATH=$2 python3 /work/wt/dec21/benchmarks/models/weight_format.py $S --context 8150 --nproc 1 --weight-format packed \
    --kv-cache-dtype float16 --activation-format int8 --max-new-tokens 16 2>&1 | grep -v "^WARNING"
}
A=/tmp/dec21_main/src; B=/work/wt/dec21/src
run main $A; run branch $B; run branch $B; run main $A
echo "# done, load $(cat /proc/loadavg), $(date -u +%T)"
