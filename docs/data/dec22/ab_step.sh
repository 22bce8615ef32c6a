# bash docs/data/dec22/ab_step.sh MODEL_NAME CONTEXT PAIRS [STEPS]: main (/work/main/src) and this branch side by side,
# one thread each, their timed steps started together (--barrier), so both see the same load;
# benchmarks/engine/step_cpu_profile.py --mode plain: thread CPU ms a decode step (median, mean, min, 25th percentile).
cd /work/wt/dec22
MODEL=$(treeattn models --path ${1:-smollm2}); CTX=${2:-4096}; PAIRS=${3:-3}; STEPS=${4:-48}
echo "# $(date -u +%T) model $MODEL context $CTX steps $STEPS; main $(git -C /work/main rev-parse --short HEAD), branch $(git rev-parse --short HEAD) + working tree; $(lscpu | grep 'Model name' | tr -s ' ')"
for i in $(seq $PAIRS); do
  B=/tmp/dec22_barrier_$$_$i
  echo "# pair $i $(date -u +%T) load $(cut -d' ' -f1-3 /proc/loadavg)"
  PYTHONPATH=/work/main/src python3 benchmarks/engine/step_cpu_profile.py $MODEL --context $CTX --steps $STEPS --mode plain --barrier $B > /tmp/dec22_ab_main.txt 2>&1 &
  a=$!
  PYTHONPATH=$PWD/src python3 benchmarks/engine/step_cpu_profile.py $MODEL --context $CTX --steps $STEPS --mode plain --barrier $B > /tmp/dec22_ab_branch.txt 2>&1 &
  b=$!
  wait $a $b
  rm -rf $B
  echo "main   $(grep '^{' /tmp/dec22_ab_main.txt)"
  echo "branch $(grep '^{' /tmp/dec22_ab_branch.txt)"
  python3 - <<'PY'
import json
m, b = (json.loads(next(l for l in open(f"/tmp/dec22_ab_{w}.txt") if l.startswith("{"))) for w in ("main", "branch"))
print("ratio branch/main: " + ", ".join(f"{k} {b[k] / m[k]:.3f}" for k in ("step_ms_median", "step_ms_mean", "step_ms_min", "step_ms_p25"))
      + f"; same tokens: {m['token_ids'] == b['token_ids']}")
PY
done
echo "# end $(date -u +%T) load $(cut -d' ' -f1-3 /proc/loadavg)"
