"""Issue 47's table in one command: the Helix layouts, the sequence-only layout, one process and llama.cpp, alternated.

    python benchmarks/models/make_llama_gguf.py --out /tmp/llama1b.Q4_0.gguf
    python benchmarks/parallel/helix_layouts.py /tmp/llama1b.Q4_0.gguf --context 4096 \
        --llama-python /work/llama/venv/bin/python --output docs/data/helix_layouts_4k.txt

For one prompt of --context random token ids (random.Random(0), ids in [100, 49000): the vocabulary
`make_llama_gguf.py` encodes text into), each layout runs `treeattn generate MODEL --prompt-ids FILE
--max-new-tokens N --ignore-eos --json` in a fresh process (greedy), and llama.cpp (llama-cpp-python in
the interpreter --llama-python, never a treeattn dependency) decodes the same ids greedily with
--llama-threads threads:

    seq   --nproc 2 --threads 1          the sequence-only layout: every rank holds and streams all weights
    tp1   --nproc 2 --tp 1 --threads 1   Helix T=1: KV split by sequence, o_proj / MLP / LM head over both
    tp2   --nproc 2 --tp 2 --threads 1   Helix T=2: heads, MLP and LM head split, no combine
    one   --nproc 1 --threads 2          one process, both cores' threads on one copy of the weights
    llama llama.cpp, 2 threads           (f16 KV cache, its default; n_ctx = prompt + new tokens)

Each round runs every layout once, in an order rotated by one between rounds, so a change in the
machine's load touches every layout alike. Time per token: the engine's decode steps on rank 0
(treeattn), the mean time of the tokens after the first (llama.cpp). Printed and written to --out: a
header (machine, command, file), one JSON line per run (with the load average before and after it),
then the table: ms per token per round, the ratios to the sequence-only layout, to one process and to
llama.cpp (each round's, alternated), weight bytes per rank, and whether the greedy tokens equal the
first treeattn layout's.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from treeattn.bench import harness

LAYOUTS = {
    "seq": ["--nproc", "2", "--threads", "1"],
    "tp1": ["--nproc", "2", "--tp", "1", "--threads", "1"],
    "tp2": ["--nproc", "2", "--tp", "2", "--threads", "1"],
    "one": ["--nproc", "1", "--threads", "2"],
}
NAMES = {"seq": "sequence-only, 2 ranks", "tp1": "Helix T=1, 2 ranks", "tp2": "Helix T=2, 2 ranks",
         "one": "one process, 2 threads",
         "llama": "llama.cpp, 2 threads"}

def treeattn_run(model: str, ids: str, layout: str, new: int, kv_cache_dtype: str, activation_format: str) -> dict:
    cmd = [sys.executable, "-m", "treeattn", "generate", model, "--prompt-ids", ids, "--max-new-tokens", str(new), "--ignore-eos",
           "--kv-cache-dtype", kv_cache_dtype, "--activation-format", activation_format, *LAYOUTS[layout], "--json"]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{shlex.join(cmd)} failed ({done.returncode}): {done.stderr[-2000:]}")
    r = json.loads(done.stdout)
    t = r["timings"]
    return {"tokens": r["generated_ids"], "ms_per_token": 1e3 * t["time_per_token_s"], "prefill_s": t["prefill_s"],
            "weight_bytes_per_rank": r["weight_bytes_per_rank"], "kv_bytes_per_rank": r["kv_bytes_per_rank"],
            "kv_cache_dtype": r["kv_cache_dtype"], "activation_format": r.get("activation_format"),
            "comm_bytes_per_token": r["comm"]["bytes_per_token"]}


def llama_run(python: str, model: str, ids: str, new: int, threads: int) -> dict:
    r = harness.llama_cpp_greedy(python, model, ids, new, threads)
    return {"tokens": r["tokens"], "ms_per_token": r["ms_per_token"], "prefill_s": r["prefill_s"],
            "weight_bytes_per_rank": [os.path.getsize(model)], "kv_cache_dtype": "float16"}


def table(runs: list[dict], layouts: list[str]) -> list[str]:
    """The summary lines: per layout, ms per token in each round and its ratios to the other layouts' same round."""
    rounds = sorted({r["round"] for r in runs})
    ms = {(r["layout"], r["round"]): r["ms_per_token"] for r in runs}
    first = next(r["tokens"] for r in runs if r["layout"] != "llama")
    lines = ["| layout | ms / token (rounds) | / sequence-only | / one process | / llama.cpp | prefill s | weight bytes / rank | "
             "tokens = first treeattn layout's |", "|---|---|---|---|---|---|---|---|"]

    def ratio(layout: str, other: str) -> str:
        values = [ms[layout, i] / ms[other, i] for i in rounds if (layout, i) in ms and (other, i) in ms]
        return " / ".join(f"{v:.2f}x" for v in values) or "-"

    for layout in layouts:
        mine = [r for r in runs if r["layout"] == layout]
        if not mine:
            continue
        equal = all(r["tokens"] == first for r in mine)
        times = " / ".join(f"{r['ms_per_token']:.1f}" for r in mine)
        prefill = " / ".join(f"{r['prefill_s']:.1f}" for r in mine)
        lines.append(f"| {NAMES[layout]} | {times} | {ratio(layout, 'seq')} | {ratio(layout, 'one')} | {ratio(layout, 'llama')} "
                     f"| "
                     f"{prefill} | {mine[0]['weight_bytes_per_rank']} | {'yes' if equal else 'no'} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", metavar="MODEL", help="a .gguf file (benchmarks/models/make_llama_gguf.py's)")
    parser.add_argument("--context", type=int, default=4096, help="prompt tokens (random ids), minus the new tokens")
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--layouts", nargs="+", default=["seq", "tp1", "tp2", "one", "llama"], choices=[*LAYOUTS, "llama"])
    parser.add_argument("--kv-cache-dtype", default="auto", help="treeattn's --kv-cache-dtype (auto: float32 on the CPU)")
    parser.add_argument("--activation-format", default="auto", choices=["auto", "float32", "int8"],
                        help="treeattn's --activation-format (int8: 8-bit activations for the packed weights, as llama.cpp "
                             "multiplies)")
    parser.add_argument("--llama-python", default=None, help="a Python with llama-cpp-python (without it: no llama.cpp row)")
    parser.add_argument("--llama-threads", type=int, default=2)
    parser.add_argument("--output", default=None, help="also write everything printed to this file")
    args = parser.parse_args()
    layouts = [x for x in args.layouts if x != "llama" or args.llama_python]
    out = open(args.output, "w") if args.output else None

    def say(line: str) -> None:
        print(line, flush=True)
        if out:
            out.write(line + "\n")
            out.flush()

    rng = random.Random(0)
    prompt = [rng.randrange(100, 49000) for _ in range(args.context - args.max_new_tokens)]
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               platform.machine())
    say(f"# {shlex.join([Path(sys.executable).name, *sys.argv])}")
    say(f"# {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}, {cpu}, {os.cpu_count()} cores, file {Path(args.model).name} "
        f"({os.path.getsize(args.model)} bytes), prompt {len(prompt)} random ids, {args.max_new_tokens} greedy tokens, "
        f"treeattn KV {args.kv_cache_dtype}, activations {args.activation_format}")
    runs = []
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(prompt, f)
    try:
        for i in range(args.rounds):
            for layout in layouts[i % len(layouts):] + layouts[: i % len(layouts)]:
                before = open("/proc/loadavg").read().split()[:3]
                try:
                    r = (llama_run(args.llama_python, args.model, f.name, args.max_new_tokens,
                                   args.llama_threads) if layout == "llama"
                         else treeattn_run(args.model, f.name, layout, args.max_new_tokens, args.kv_cache_dtype,
                                           args.activation_format))
                except SystemExit as failed:  # one layout's failure (llama.cpp not importable, say) leaves the others' rows
                    say(f"# {layout} round {i}: {failed}")
                    continue
                r.update(layout=layout, round=i, load_before=before, load_after=open("/proc/loadavg").read().split()[:3])
                runs.append(r)
                say(json.dumps(r))
    finally:
        os.unlink(f.name)
    for line in table(runs, layouts):
        say(line)
    if out:
        out.close()


if __name__ == "__main__":
    main()
