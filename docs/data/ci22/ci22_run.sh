#!/usr/bin/env bash
# ci22: the wrapper of the full runs (docs/data/ci22/*_xdist*.txt, try1): header (command, host, uptime), pytest under `time`, rc, wall
# usage: ci22_run.sh OUTFILE pytest-args...
out=$1; shift
cd /work/wt/ci22
{
echo "# command: PYTHONPATH=\$PWD/src python3 -m pytest -q $*   (in /work/wt/ci22, commit $(git rev-parse --short HEAD)$(git diff --quiet || echo ' + uncommitted changes'))"
echo "# host: $(lscpu | grep 'Model name' | sed 's/  */ /g'), $(nproc) cores"
echo "# date: $(date -u)"
echo "# uptime before: $(uptime)"
echo "# top CPU before:"; ps aux --sort=-%cpu | head -6 | cut -c1-180 | sed "s/^/#   /"
start=$(date +%s.%N)
( time CI22_LOG=/tmp/ci22_run3.log PYTHONPATH=$PWD/src:/tmp/ci22plug python3 -m pytest -q "$@" ) 2>&1
rc=$?
end=$(date +%s.%N)
echo "# rc: $rc"
echo "# wall: $(python3 -c "print(round($end-$start,1))") s"
echo "# uptime after: $(uptime)"
} > "$out" 2>&1
