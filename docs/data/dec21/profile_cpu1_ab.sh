# dec21: main (git archive of main 3e3694a's src in /tmp/dec21_main) and this branch, run at the same time (one
# thread each, 2 cores: the same load for both), 1 rank, one torch thread, the paged kernel serial; time.perf_counter
# replaced by time.thread_time in every process (/tmp/dec21_cpu/sitecustomize.py with DEC21_THREAD_TIME=1:
# `import os, time; if os.environ.get("DEC21_THREAD_TIME") == "1": time.perf_counter = time.thread_time`),
# so each phase is the rank thread's CPU ms a decode step, robust to a loaded machine.
S=$(PYTHONPATH=/work/wt/dec21/src treeattn models --path smollm2); G=$(PYTHONPATH=/work/wt/dec21/src treeattn models --path gemma3)
prof() {  # $1 label, $2 src, $3 model, $4 context
  out=$(DEC21_THREAD_TIME=1 PYTHONPATH=/tmp/dec21_cpu:$2 treeattn bench profile $3 --nproc 1 --threads 1 --context $4 \
    --max-new-tokens 10 --activation-format int8 --kv-cache-dtype float16 --weight-format packed -m onepass 2>&1 | grep "│ 1 ")
  echo "## $1 $(basename $3) context $4, done $(date -u +%T), load $(cut -d' ' -f1-3 /proc/loadavg): $out"
}
for cell in "$S 8192" "$S 4096" "$G 4096"; do set -- $cell
  echo "# $(basename $1) $2: start $(date -u +%T), load $(cut -d' ' -f1-3 /proc/loadavg)"
  prof main /tmp/dec21_main/src $1 $2 & prof branch /work/wt/dec21/src $1 $2 & wait
done
echo "# done $(date -u +%T), load $(cat /proc/loadavg)"
