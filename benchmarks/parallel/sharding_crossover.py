"""Where sharding the KV cache pays on this machine: time per token of p ranks against one process, measured alternately.

    python3 benchmarks/parallel/sharding_crossover.py --context 2048 4096 8000 --nproc 2 --rounds 3 --output crossover.json
    python3 benchmarks/parallel/sharding_crossover.py --context 8000 --kv-cache-dtype bfloat16 --rounds 4
    python3 benchmarks/parallel/sharding_crossover.py --context 4096 --tp 1 --rounds 3    # a third engine: the ranks in the
    Helix layout

For each context the demo's needle document (treeattn.eval.haystack, the model's chat template if it
has one) is prefilled once into two engines that stay up side by side: one process (all the cores'
threads) and `--nproc` local ranks (tree decoding, the cores split among them). Then each round asks
both engines the same prompt again (the prefix cache holds it: only its last partial block is
recomputed) for --max-new-tokens greedy tokens, the order alternating from round to round so that
both see the same load; a round's time per token is decode_s / (tokens - 1). The JSON records every
round's two times, their ratio, the greedy tokens (they must agree) and the load average around it.
With --tp T a third engine runs the same ranks in the Helix layout (EngineConfig.tp = T: the MLP,
output projections and LM head split over the ranks too; `treeattn demo`'s default is T = 1), asked
in the same rotation; its keys end in "_tp" (ms_per_token_{nproc}_tp, ratio_tp: against one process).
"""

from __future__ import annotations

import json
import os
import statistics
import time

from treeattn.bench import harness


def model_path(name: str) -> str:
    from treeattn.eval.demo import gemma3_path, smollm2_path

    return str({"smollm2": smollm2_path, "gemma3": gemma3_path}[name]()) if name in ("smollm2", "gemma3") else name


def measure(path: str, context: int, nproc: int, rounds: int, new_tokens: int, kv_cache_dtype: str = "auto",
            tp: int | None = None) -> dict:
    import treeattn as ta
    from treeattn.eval.haystack import needle_case
    from treeattn.models.loader import read_model_files

    files = read_model_files(path)
    case = needle_case(files.tokenizer, files.chat_template, context_tokens=context, depth=0.5, seed=0)
    keys = ["1", str(nproc)] + ([f"{nproc}_tp"] if tp is not None else [])
    engines = {key: ta.Engine(path, nproc=1 if key == "1" else nproc, tp=tp if key.endswith("_tp") else None,
                              kv_cache_dtype=kv_cache_dtype) for key in keys}
    row = {"context": context, "prompt_tokens": len(case.prompt_ids), "nproc": nproc, "tp": tp, "cores": os.cpu_count(),
           "kv_cache_dtype": kv_cache_dtype, "rounds": []}
    try:
        for key, engine in engines.items():  # the prefill, not timed here
            start = time.perf_counter()
            engine.generate([case.prompt_ids], max_new_tokens=2, ignore_eos=True)
            row[f"prefill_s_{key}"] = time.perf_counter() - start
        for r in range(rounds):
            times, tokens = {}, {}
            load = os.getloadavg()[0]
            for key in keys[r % len(keys):] + keys[:r % len(keys)]:  # each engine first in turn
                result = engines[key].generate([case.prompt_ids], max_new_tokens=new_tokens, ignore_eos=True)[0]
                times[key] = result.decode_s / (len(result.token_ids) - 1) * 1e3
                tokens[key] = result.token_ids
            record = {f"ms_per_token_{key}": times[key] for key in keys}
            record.update({"ratio": times[str(nproc)] / times["1"], "same_tokens": all(t == tokens["1"] for t in tokens.values()),
                           "load_before": load, "load_after": os.getloadavg()[0]})
            if tp is not None:
                record["ratio_tp"] = times[f"{nproc}_tp"] / times["1"]
            row["rounds"].append(record)
            print(json.dumps(row["rounds"][-1]), flush=True)
    finally:
        for engine in engines.values():
            engine.close()
    row["median_ratio"] = statistics.median(x["ratio"] for x in row["rounds"])
    if tp is not None:
        row["median_ratio_tp"] = statistics.median(x["ratio_tp"] for x in row["rounds"])
    return row


def main() -> None:
    parser = harness.parser(__doc__, context=[2048, 4096, 8000], nproc=2, max_new_tokens=12,
                            kv_cache_dtype="auto")
    parser.add_argument("model", nargs="?", default="smollm2", metavar="MODEL", help="smollm2, gemma3 or a model path")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tp", type=int, default=None,
                        help="also the ranks in the Helix layout with this many tensor-parallel ranks")
    args = harness.parse_args(parser)
    path = model_path(args.model)
    rows = []
    for context in args.context:
        rows.append(measure(path, context, args.nproc, args.rounds, args.max_new_tokens, args.kv_cache_dtype, args.tp))
        helix = f"; with --tp {args.tp}: {rows[-1]['median_ratio_tp']:.2f}" if args.tp is not None else ""
        print(f"context {context}: {args.nproc} ranks / 1 process, median of {args.rounds} rounds: {rows[-1]['median_ratio']:.2f}"
              + helix, flush=True)
    harness.write_output(args.output, {"model": path, "command": " ".join(os.sys.argv), "rows": rows})


if __name__ == "__main__":
    main()
