#!/bin/bash
# Session 23: issue 47's 16K row, quiet (helpers only reading/writing code; /work/wt/QUIET present while it runs)
cd /work/main && export PYTHONPATH=/work/main/src
Q=/work/main/docs/data/quiet_s23; L=/work/llama/venv/bin/python
stamp() { echo "## $(date -u +%H:%M:%S) load $(cut -d' ' -f1-3 /proc/loadavg) :: $*"; }
{
stamp "lscpu: $(lscpu | grep 'Model name' | tr -s ' ')"
stamp "git $(git log --oneline -1)"
stamp warmup; python3 -m treeattn.ops.warmup >/dev/null 2>&1
stamp "w47 helix 16k"
echo "# python3 benchmarks/parallel/helix_layouts.py /tmp/llama1b.Q4_0.gguf --context 16384 --rounds 1 --layouts tp2 seq one llama --max-new-tokens 32 --kv-cache-dtype float16 --activation-format int8 --llama-python $L --output $Q/helix_layouts_16k.txt"
python3 benchmarks/parallel/helix_layouts.py /tmp/llama1b.Q4_0.gguf --context 16384 --rounds 1 --layouts tp2 seq one llama --max-new-tokens 32 --kv-cache-dtype float16 --activation-format int8 --llama-python $L --output $Q/helix_layouts_16k.txt > $Q/helix_16k.log 2>&1
tail -12 $Q/helix_16k.log
stamp done
} >> $Q/run.log 2>&1
rm -f /work/wt/QUIET
