# dec21: profile_cpu1_ab.sh's pairs again, SmolLM2 only, 2 more rounds of 8K and 4K, 16 measured tokens (--max-new-tokens 18).
S=$(PYTHONPATH=/work/wt/dec21/src treeattn models --path smollm2)
prof() {  # $1 label, $2 src, $3 model, $4 context
  out=$(DEC21_THREAD_TIME=1 PYTHONPATH=/tmp/dec21_cpu:$2 treeattn bench profile $3 --nproc 1 --threads 1 --context $4 \
    --max-new-tokens 18 --activation-format int8 --kv-cache-dtype float16 --weight-format packed -m onepass 2>&1 | grep "│ 1 ")
  echo "## $1 $(basename $3) context $4, done $(date -u +%T), load $(cut -d' ' -f1-3 /proc/loadavg): $out"
}
for round in 1 2; do for n in 8192 4096; do
  echo "# round $round, $n: start $(date -u +%T), load $(cut -d' ' -f1-3 /proc/loadavg)"
  prof main /tmp/dec21_main/src $S $n & prof branch /work/wt/dec21/src $S $n & wait
done; done
echo "# done $(date -u +%T), load $(cat /proc/loadavg)"
