#!/bin/bash
# Session 18 (dec18), UNDER LOAD: the exact float32 activation path against int8 and llama.cpp at 4K, SmolLM2 then Gemma 3, 1 rank.
cd "$(dirname "$0")/../.." && export PYTHONPATH=$PWD/src
L=/work/llama/venv/bin/python
for MODEL in smollm2 gemma3; do
  M=$(treeattn models --path $MODEL)
  echo "## $MODEL $(date -u +%FT%TZ) git $(git log --oneline -1 | cut -c1-50) load $(cut -d' ' -f1-3 /proc/loadavg)"
  echo "# python3 benchmarks/models/weight_format.py $M --context 4096 --nproc 1 --weight-format packed --kv-cache-dtype float16 --activation-format float32 int8 --llama-python $L --llama-threads 2 --max-new-tokens 16"
  python3 benchmarks/models/weight_format.py $M --context 4096 --nproc 1 --weight-format packed --kv-cache-dtype float16 \
    --activation-format float32 int8 --llama-python $L --llama-threads 2 --max-new-tokens 16 2>&1 | grep -v '^\s*$' | tail -6
done
