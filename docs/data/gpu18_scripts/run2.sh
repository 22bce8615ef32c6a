#!/usr/bin/env bash
# gpu18's second device call: gpu18/src (main's src + the packed-buffers fix), the packed runs again and a warm-engine A/B.
set -u
G=$PWD/gpu18; W=/tmp/gpu18w2; rm -rf "$W"; mkdir -p "$W" "$OUT"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$G"/whl/*.whl || exit 1
export PYTHONPATH=$G/src:/tmp/site
log() { echo "[$(date -u +%T) +${SECONDS}s] $*" | tee -a "$W/steps.txt"; }
python3 benchmarks/models/make_llama_gguf.py --out "$W/smol.gguf" --type q4_0 --layers 30 --hidden 576 --heads 9 --kv-heads 3 \
    --ffn 1536 --vocab 49152 --rope-theta 100000 --max-position-embeddings 8192 --tokenizer "$G/tok.gguf" >"$W/make_smol.log" 2>&1 &
python3 benchmarks/models/make_llama_gguf.py --out "$W/llama1b.gguf" --type q4_0 --tokenizer "$G/tok.gguf" >"$W/make_llama1b.log" 2>&1 &
wait; log "models made"; md5sum "$W"/*.gguf | tee -a "$W/steps.txt"
for step in dynamic graph; do
    timeout 60 python3 -m treeattn generate "$W/smol.gguf" --device cuda --prompt-ids "$G/smollm_ids_4096.json" --max-new-tokens 32 \
        --ignore-eos --weight-format packed --decode-step $step --json >"$W/smol_packed_$step.json" 2>"$W/smol_packed_$step.err"
    log "smol_packed_$step: rc=$?"; tail -2 "$W/smol_packed_$step.err"
done
tar czf "$OUT/gpu18_2.tgz" -C /tmp --exclude "*.gguf" gpu18w2
timeout $((230 - SECONDS)) python3 "$G/steady.py" cuda "$G/smollm_ids_4096.json" 33 "$W/smol.gguf" "$W/llama1b.gguf" 2>"$W/steady.err" | tee "$W/steady.jsonl" | cut -c1-260
log "steady: rc=$?"; tail -3 "$W/steady.err"
tar czf "$OUT/gpu18_2.tgz" -C /tmp --exclude "*.gguf" gpu18w2
