"""Prefill of one needle prompt, this checkout against another, in alternated rounds (docs/bench_weights.md,
"Session 18, prefill").

    python benchmarks/models/prefill_ab.py "$(treeattn models --path gemma3)" --baseline-src /tmp/base/src \
        --context 4096 --nproc 1 --repeats 2 --output docs/data/x.jsonl
    python benchmarks/models/prefill_ab.py "$(treeattn models --path smollm2)" --baseline-src src --prefill-dtype bfloat16 \
        --context 4096 --nproc 1 --repeats 2 --output docs/data/y.jsonl      # float32 against bfloat16 prefill, one checkout

For the needle-in-a-haystack prompt of about --context tokens (treeattn.eval.haystack, as
benchmarks/models/weight_format.py builds it), each round runs `treeattn generate MODEL --prompt-ids FILE
--ignore-eos --json` (packed weights, --kv-cache-dtype, --activation-format) once with PYTHONPATH set to
--baseline-src (another checkout's src/, e.g. `git archive HEAD src | tar -x -C /tmp/base`) and once with
--src (default: this checkout's src/), the order swapped every round. Each run reports prefill_s (time to the first token,
engine setup included), setup_s (the engine's construction inside it: GenerationResult.setup_s; absent
before it existed: null), the run's CPU seconds (user + system of the child process and its ranks,
getrusage) and its greedy tokens. A first untimed run of each side fills numba's cache for that source
tree. Prints a row per run and the medians per side, with the load average before and after.
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from treeattn.bench import harness

HERE = Path(__file__).resolve().parents[2] / "src"


def run(model: str, ids_file: str, src: str, args, nproc: int, prefill_dtype: str = "float32") -> dict:
    cmd = [sys.executable, "-m", "treeattn.cli", "generate", model, "--prompt-ids", ids_file, "--ignore-eos", "--json",
           "--max-new-tokens", str(args.max_new_tokens), "--nproc", str(nproc), "--weight-format", "packed",
           "--kv-cache-dtype", args.kv_cache_dtype, "--activation-format", args.activation_format]
    if prefill_dtype != "float32":  # only then: a checkout from before --prefill-dtype runs float32 without it
        cmd += ["--prefill-dtype", prefill_dtype]
    before, load = resource.getrusage(resource.RUSAGE_CHILDREN), os.getloadavg()[0]
    done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": src})
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode:
        raise SystemExit(f"{cmd} with PYTHONPATH={src} failed: {done.stderr[-2000:]}")
    r = json.loads(done.stdout)
    return {"prefill_s": r["timings"]["prefill_s"], "setup_s": r["timings"].get("setup_s"),
            "cpu_s": round(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime, 2),
            "tokens": r["generated_ids"], "load_before_after": (round(load, 2), round(os.getloadavg()[0], 2))}


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The index of the first generated token where a and b differ; None where they agree."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def main() -> None:
    parser = harness.parser(__doc__, model="smollm2", context=4096, nproc=[1], max_new_tokens=16, repeats=2,
                            kv_cache_dtype="float16")
    parser.add_argument("--baseline-src", required=True, help="the other checkout's src/ directory (PYTHONPATH of side A)")
    parser.add_argument("--src", default=str(HERE), help="side B's src/ directory (default: this checkout's; a copy of it "
                        "keeps edits made while the rounds run out of them)")
    parser.add_argument("--activation-format", default="int8", help="as `treeattn generate --activation-format`")
    parser.add_argument("--prefill-dtype", default="float32", choices=["float32", "bfloat16"],
                        help="side B's `treeattn generate --prefill-dtype` (side A runs float32); with --baseline-src set to "
                        "this checkout's src/ the two sides differ in it only")
    args = harness.parse_args(parser)

    from treeattn.eval.haystack import needle_case
    from treeattn.models.loader import read_model_files

    files = read_model_files(args.model)
    case = needle_case(files.tokenizer, files.chat_template, context_tokens=args.context, depth=0.5, seed=0)
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(case.prompt_ids, f)
    sides = {"baseline": str(Path(args.baseline_src).resolve()), "this": str(Path(args.src).resolve())}
    rows = []
    for nproc in args.nproc:
        for name, src in sides.items():  # numba's cache of each source tree, and the page cache
            run(args.model, f.name, src, args, nproc, args.prefill_dtype if name == "this" else "float32")
        for r in range(args.repeats):
            for name in (("baseline", "this") if r % 2 == 0 else ("this", "baseline")):
                row = {"model": Path(args.model).name, "prompt_tokens": len(case.prompt_ids), "nproc": nproc, "side": name,
                       "round": r,
                       **run(args.model, f.name, sides[name], args, nproc, args.prefill_dtype if name == "this" else "float32")}
                print(json.dumps(row), flush=True)
                rows.append(row)
    os.unlink(f.name)
    for nproc in args.nproc:
        mine = {name: [r for r in rows if r["nproc"] == nproc and r["side"] == name] for name in sides}
        summary = {"nproc": nproc, "tokens_equal": all(r["tokens"] == mine["baseline"][0]["tokens"] for rs in mine.values()
                                                       for r in rs),
                   "first_differing_token": first_difference(mine["baseline"][0]["tokens"], mine["this"][0]["tokens"])}
        for name, rs in mine.items():
            for key in ("prefill_s", "cpu_s"):
                summary[f"{name}_{key}_median"] = round(statistics.median(r[key] for r in rs), 2)
        print(json.dumps(summary))
        rows.append({"summary": summary})
    harness.write_output(args.output, rows)


if __name__ == "__main__":
    main()
