"""Session 18 (pre18): `treeattn generate` with --prefill-chunk values in the order given (one rank, packed, float16 KV,
8-bit decode activations, 16 greedy tokens), each with its prefill_s, setup_s, process CPU seconds and tokens.

    PYTHONPATH=src python3 docs/data/pre18_chunk_ab.py MODEL PROMPT_IDS.json 512 2048 2048 512
"""
import json, os, resource, subprocess, sys
model, ids = sys.argv[1], sys.argv[2]
for chunk in sys.argv[3:]:
    cmd = [sys.executable, "-m", "treeattn.cli", "generate", model, "--prompt-ids", ids, "--ignore-eos", "--json", "--max-new-tokens", "16",
           "--nproc", "1", "--weight-format", "packed", "--kv-cache-dtype", "float16", "--activation-format", "int8", "--prefill-chunk", chunk]
    b, l = resource.getrusage(resource.RUSAGE_CHILDREN), os.getloadavg()[0]
    r = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)
    a = resource.getrusage(resource.RUSAGE_CHILDREN)
    print(json.dumps({"prefill_chunk": int(chunk), "prefill_s": round(r["timings"]["prefill_s"], 2), "setup_s": round(r["timings"]["setup_s"], 2),
                      "cpu_s": round(a.ru_utime + a.ru_stime - b.ru_utime - b.ru_stime, 2), "tokens": r["generated_ids"],
                      "load_before_after": [round(l, 2), round(os.getloadavg()[0], 2)]}), flush=True)
