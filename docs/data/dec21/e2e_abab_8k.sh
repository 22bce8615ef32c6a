# dec21: as e2e_abab.sh, SmolLM2 at --context 8150 (a needle prompt of 8,140 tokens, session 20's length; --context 8192
# now builds 8,177 tokens, which with 16 new tokens the CLI refuses: beyond the model's 8,192 positions), A B B A.
S=$(PYTHONPATH=/work/wt/dec21/src treeattn models --path smollm2)
run() {  # $1 label, $2 src, $3 model, $4 context
  echo "## $1 $(basename $3) context $4, load $(cut -d' ' -f1-3 /proc/loadavg), $(date -u +%T)"
  PYTHONPATH=$2 python3 /work/wt/dec21/benchmarks/models/weight_format.py $3 --context $4 --nproc 1 --weight-format packed \
    --kv-cache-dtype float16 --activation-format int8 --max-new-tokens 16 2>&1 | grep -v "^WARNING"
}
A=/tmp/dec21_main/src; B=/work/wt/dec21/src
run main $A $S 8150; run branch $B $S 8150; run branch $B $S 8150; run main $A $S 8150
echo "# done, load $(cat /proc/loadavg), $(date -u +%T)"
