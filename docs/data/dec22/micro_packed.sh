# bash docs/data/dec22/micro_packed.sh: main and this branch alternated, two rounds
cd /work/wt/dec22
for r in 1 2; do
  echo "# round $r $(date -u +%T) load $(cut -d' ' -f1-3 /proc/loadavg)"
  PYTHONPATH=/work/main/src python3 docs/data/dec22/micro_packed.py main
  PYTHONPATH=$PWD/src python3 docs/data/dec22/micro_packed.py branch
done
