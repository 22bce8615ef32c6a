"""llama.cpp's decode time per token with float16 and q8_0 KV caches (flash attention on for both), at two
prompt lengths, on one GGUF: the growth from the short to the long prompt is what its attention costs per
token over the extra keys. Run with llama.cpp's Python (llama-cpp-python), e.g.

    /work/llama/venv/bin/python docs/data/kern19_llama_kv_types_s19.py /tmp/k19_tiny_llama.gguf 1024 16320 --threads 2

(/tmp/k19_tiny_llama.gguf: benchmarks/models/make_llama_gguf.py --out ... --layers 2 --ffn 512 --vocab 49152,
Llama-3.2-1B's attention shape with 2 layers, so that a 16K prefill is short.) Greedy, --new tokens; the
(context, kv type) runs alternate within each of --rounds rounds.
"""
import argparse
import os
import random
import time

import llama_cpp

p = argparse.ArgumentParser()
p.add_argument("model")
p.add_argument("contexts", type=int, nargs="+")
p.add_argument("--threads", type=int, default=2)
p.add_argument("--new", type=int, default=48)
p.add_argument("--rounds", type=int, default=1)
a = p.parse_args()
types = {"f16": llama_cpp.GGML_TYPE_F16, "q8_0": llama_cpp.GGML_TYPE_Q8_0}
print(f"# load {os.getloadavg()}")
for rnd in range(a.rounds):
    for n in a.contexts:
        random.seed(0)
        ids = [random.randrange(3, 49000) for _ in range(n)]
        for name, t in types.items():
            llm = llama_cpp.Llama(model_path=a.model, n_ctx=n + a.new + 8, n_threads=a.threads, n_threads_batch=a.threads,
                                  n_batch=512, flash_attn=True, type_k=t, type_v=t, verbose=False)
            t0 = time.perf_counter()
            llm.eval(ids)
            prefill = time.perf_counter() - t0
            steps = []
            tok = None
            for _ in range(a.new):
                tok = int(llm._scores[-1].argmax()) if tok is None else tok
                s = time.perf_counter()
                llm.eval([tok])
                steps.append(time.perf_counter() - s)
                tok = int(llm._scores[-1].argmax())
            steps = sorted(steps[2:])
            print(f"round {rnd} context {n} kv {name}: prefill {prefill:.1f} s, decode median {1e3 * steps[len(steps) // 2]:.2f} ms/token "
                  f"(p10 {1e3 * steps[len(steps) // 10]:.2f}, p90 {1e3 * steps[9 * len(steps) // 10]:.2f}), load {os.getloadavg()[0]:.2f}",
                  flush=True)
            del llm
