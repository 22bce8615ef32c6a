#!/usr/bin/env bash
# gpu18's device script (issue 54): run from the repository root with gpu18/ carried.
#   bash gpu18/run.sh            # on the H200: DEVICE=cuda, OUT set by the device tool
#   DEVICE=cpu OUT=/tmp/g18 bash gpu18/run.sh   # dry run on a CPU host, small sizes
# Everything goes to $W (/tmp/gpu18w); after each phase $W is tarred into $OUT/gpu18.tgz and the
# table into $OUT/summary.txt, so a run stopped by its limit still brings back what it did.
set -u
DEVICE=${DEVICE:-cuda}
BUDGET=${BUDGET:-400}
G=$PWD/gpu18
W=/tmp/gpu18w; rm -rf "$W"; mkdir -p "$W" "$OUT"
export PYTHONUNBUFFERED=1
if [ "$DEVICE" = cuda ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$G"/whl/*.whl || exit 1
    export PYTHONPATH=$PWD/src:$PWD/tests:/tmp/site
    SMOL_IDS=$G/smollm_ids_4096.json; SHAPE="--layers 30 --hidden 576 --heads 9 --kv-heads 3 --ffn 1536"; NEW=32; CPU_NEW=4
else
    export PYTHONPATH=$PWD/src:$PWD/tests
    SMOL_IDS=$G/smollm_ids_256.json; SHAPE="--layers 2 --hidden 128 --heads 2 --kv-heads 1 --ffn 256"; NEW=4; CPU_NEW=2
fi
left() { echo $((BUDGET - SECONDS)); }
save() { tar czf "$OUT/gpu18.tgz" -C /tmp --exclude "*.gguf" gpu18w 2>/dev/null; python3 "$G/summary.py" "$W" >"$OUT/summary.txt" 2>&1; }
log() { echo "[$(date -u +%T) +${SECONDS}s] $*" | tee -a "$W/steps.txt"; }
gen() {  # gen NAME SECONDS ARGS...: one `treeattn generate --json`, kept as $W/NAME.json (+ .err)
    local name=$1 limit=$2; shift 2
    local t=$SECONDS room=$(( $(left) - 5 ))
    [ "$room" -lt "$limit" ] && limit=$room
    [ "$limit" -lt 10 ] && { log "skip $name: $(left)s left"; return; }
    timeout "$limit" python3 -m treeattn generate "$@" --json >"$W/$name.json" 2>"$W/$name.err"
    log "$name: rc=$? $((SECONDS - t))s: $*"; tail -2 "$W/$name.err"
}

log "env"
{ date -u; nvidia-smi; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.is_available() and torch.cuda.get_device_name()); print('triton', triton.__version__)"
  python3 -c "import numba, gguf; print('numba', numba.__version__, 'gguf', gguf.__file__)"; nproc; git log --oneline -1; } >"$W/env.txt" 2>&1
cat "$W/env.txt" | tail -6

# phase A: the models (CPU, background) and then the CPU float32 reference runs, while the tests run on the GPU
(
  t=$SECONDS
  python3 benchmarks/models/make_llama_gguf.py --out "$W/smol.gguf" --type q4_0 $SHAPE --vocab 49152 \
      --rope-theta 100000 --max-position-embeddings 8192 --tokenizer "$G/tok.gguf" >"$W/make_smol.log" 2>&1
  log "make smol: rc=$? $((SECONDS - t))s"
  gen smol_cpu_f32 150 "$W/smol.gguf" --device cpu --dtype float32 --prompt-ids "$SMOL_IDS" --max-new-tokens $CPU_NEW --ignore-eos
  gen gemma_cpu_f32 60 "$G/gemma3_tiny.gguf" --device cpu --dtype float32 --prompt-ids "$G/gemma_ids_2000.json" --max-new-tokens 16 --ignore-eos
) &
BG=$!
LLAMA_SHAPE=""; [ "$DEVICE" = cpu ] && LLAMA_SHAPE="--layers 1 --hidden 256 --heads 4 --kv-heads 2 --ffn 512"
( t=$SECONDS; python3 benchmarks/models/make_llama_gguf.py --out "$W/llama1b.gguf" --type q4_0 $LLAMA_SHAPE \
      --tokenizer "$G/tok.gguf" >"$W/make_llama1b.log" 2>&1; log "make llama1b: rc=$? $((SECONDS - t))s" ) &
BG2=$!
if [ "$DEVICE" = cuda ]; then
    t=$SECONDS; timeout 60 python3 -m pytest -q -p no:cacheprovider -rs tests/test_packed_triton.py >"$W/pytest_packed_triton.log" 2>&1
    log "pytest packed_triton: rc=$? $((SECONDS - t))s"; tail -3 "$W/pytest_packed_triton.log"
    t=$SECONDS; timeout 60 python3 -m pytest -q -p no:cacheprovider -rs \
        "tests/test_paged_decode.py::test_cuda_branch_through_the_triton_interpreter" >"$W/pytest_cuda_branch.log" 2>&1
    log "pytest cuda branch: rc=$? $((SECONDS - t))s"; tail -3 "$W/pytest_cuda_branch.log"
else
    t=$SECONDS; timeout 120 python3 -m pytest -q -p no:cacheprovider -rs --co tests/test_packed_triton.py \
        "tests/test_paged_decode.py::test_cuda_branch_through_the_triton_interpreter" >"$W/pytest_co.log" 2>&1
    log "pytest --co: rc=$? $((SECONDS - t))s"; tail -2 "$W/pytest_co.log"
fi
wait $BG
save

# phase B: the GPU runs, one at a time (a warm-up first: Triton's compiles land in its cache)
SMOL=$W/smol.gguf
gen warmup 90 "$SMOL" --device "$DEVICE" --prompt "Hello" --max-new-tokens 4 --weight-format packed
for fmt in packed dequantize; do
    for step in dynamic graph; do
        [ "$DEVICE" = cpu ] && [ $step = graph ] && continue
        [ "$(left)" -lt 40 ] && { log "skip smol_${fmt}_$step: $(left)s left"; continue; }
        gen "smol_${fmt}_$step" 90 "$SMOL" --device "$DEVICE" --prompt-ids "$SMOL_IDS" --max-new-tokens $NEW --ignore-eos \
            --weight-format $fmt --decode-step $step
    done
done
save
[ "$(left)" -gt 40 ] && gen smol_auto_f32_dynamic 60 "$SMOL" --device "$DEVICE" --dtype float32 --prompt-ids "$SMOL_IDS" \
    --max-new-tokens $NEW --ignore-eos --decode-step dynamic
for step in dynamic graph; do
    [ "$DEVICE" = cpu ] && [ $step = graph ] && continue
    [ "$(left)" -lt 30 ] && { log "skip gemma_$step: $(left)s left"; continue; }
    gen "gemma_$step" 60 "$G/gemma3_tiny.gguf" --device "$DEVICE" --prompt-ids "$G/gemma_ids_2000.json" --max-new-tokens 16 \
        --ignore-eos --decode-step $step
done
[ "$(left)" -gt 30 ] && gen gemma_f32_dynamic 60 "$G/gemma3_tiny.gguf" --device "$DEVICE" --dtype float32 \
    --prompt-ids "$G/gemma_ids_2000.json" --max-new-tokens 16 --ignore-eos --decode-step dynamic
save
wait $BG2
for fmt in packed dequantize; do
    step=graph; [ "$DEVICE" = cpu ] && step=dynamic
    gen "llama1b_${fmt}_$step" 90 "$W/llama1b.gguf" --device "$DEVICE" --prompt-ids "$SMOL_IDS" --max-new-tokens $NEW \
        --ignore-eos --weight-format $fmt --decode-step $step
done
[ "$DEVICE" = cuda ] && [ "$(left)" -gt 40 ] && {
    t=$SECONDS; timeout $(( $(left) - 10 )) python3 -m pytest -q -p no:cacheprovider -m gpu -rs tests/test_device.py tests/test_plan_message.py \
        tests/test_bench_profile.py tests/test_triton_decode.py tests/test_engine_static_step.py tests/test_graph_safe.py \
        tests/test_ops_attention.py >"$W/pytest_gpu.log" 2>&1
    log "pytest -m gpu: rc=$? $((SECONDS - t))s"; tail -3 "$W/pytest_gpu.log"
}
log "done, $(left)s of the budget left"
save
cat "$OUT/summary.txt"
