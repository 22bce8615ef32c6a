# PYTHONPATH=/work/wt/dec21/src, branch dec21 at its start (main 3e3694a), Intel Xeon
S=$(treeattn models --path smollm2); G=$(treeattn models --path gemma3)
for spec in "$S 4096" "$S 8192" "$G 4096"; do set -- $spec
  echo "== $1 context $2; load: $(cat /proc/loadavg) $(date -u +%T)"
  treeattn bench profile $1 --nproc 1 --context $2 --max-new-tokens 16 --activation-format int8 --kv-cache-dtype float16 --weight-format packed -m onepass 2>&1
  echo "load after: $(cat /proc/loadavg)"
done
