# dec21: main (git archive of main 3e3694a's src into /tmp/dec21_main) against this branch, alternated A B / B A,
# 1 rank, the settings; each run is benchmarks/models/weight_format.py (its JSON line), load printed per run.
S=$(PYTHONPATH=/work/wt/dec21/src treeattn models --path smollm2); G=$(PYTHONPATH=/work/wt/dec21/src treeattn models --path gemma3)
run() {  # $1 label, $2 src, $3 model, $4 context
  echo "## $1 $(basename $3) context $4, load $(cut -d' ' -f1-3 /proc/loadavg), $(date -u +%T)"
  PYTHONPATH=$2 python3 /work/wt/dec21/benchmarks/models/weight_format.py $3 --context $4 --nproc 1 --weight-format packed \
    --kv-cache-dtype float16 --activation-format int8 --max-new-tokens ${5:-16} 2>&1 | grep -v "^WARNING"
}
A=/tmp/dec21_main/src; B=/work/wt/dec21/src
for m in $S $G; do run warm-main $A $m 512 4; run warm-branch $B $m 512 4; done
run main $A $S 8192; run branch $B $S 8192; run main $A $G 4096; run branch $B $G 4096; run main $A $S 4096; run branch $B $S 4096
run branch $B $S 8192; run main $A $S 8192; run branch $B $G 4096; run main $A $G 4096; run branch $B $S 4096; run main $A $S 4096
echo "# done, load $(cat /proc/loadavg), $(date -u +%T)"
