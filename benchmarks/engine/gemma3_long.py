"""Gemma 3 270M at long contexts: greedy tokens against transformers' uncached recomputation, KV
bytes per rank against a full cache, and time per token against transformers, in one run.

    python3 benchmarks/engine/gemma3_long.py --context 8192 --nproc 1 2 4 --max-new-tokens 4 --output gemma3_8k.json
    python3 benchmarks/engine/gemma3_long.py --context 30000 --nproc 2 --max-new-tokens 2 --no-oracle
    python3 benchmarks/engine/gemma3_long.py --check-gguf     # prefill logits vs transformers' own GGUF load
    python3 benchmarks/engine/gemma3_long.py --timing --context 8192 --nproc 1 2 --max-new-tokens 12 --output t8k.json

The prompt is a needle-in-a-haystack document (treeattn.eval.haystack, plain text: the model has
no chat template). For each rank count, ta.generate (the engine, tree decoding, the hybrid KV
cache) runs on that many local gloo ranks; the JSON records its tokens, each rank's KV bytes (the
measured arena and windows), kv_bytes_per_token and kv_window_bytes, time to first token and time
per token. The oracle is transformers' Gemma3ForCausalLM carrying the same weights (copied from
the loaded model: the weights themselves are checked against transformers' own GGUF load by
tests/test_gemma3_270m.py), run with no cache: one full forward per new token. Its time per token
is transformers' own cached greedy decoding (generate with its DynamicCache, sdpa attention) of
the same prompt, in the same process.

--timing measures time per token fairly instead (no oracle tokens): for each rank count, ta.generate
on that many ranks with ignore_eos, and transformers' cached greedy decoding (sdpa, a DynamicCache
whose window layers keep their window; the prompt prefilled in 2,048-token forwards, then one
forward per token) on the same weights and prompt, each for --max-new-tokens tokens; a row reports
the median and the minimum of the decode steps after the first (which loads compiled kernels), from
the engine's step timer and from timing each of transformers' forwards, and whether the tokens
agree.
"""

from __future__ import annotations

import json
import os
import time

import torch

from treeattn.bench import harness


def transformers_twin(model):
    """transformers' Gemma3ForCausalLM (sdpa attention) with the config and weights of our loaded
    Gemma3Model `model` (its parameter names are transformers' without "model.")."""
    import transformers

    c = model.config
    config = transformers.Gemma3TextConfig(
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_layers,
        num_attention_heads=c.num_heads,
        num_key_value_heads=c.num_kv_heads,
        head_dim=c.head_dim,
        rms_norm_eps=c.rms_norm_eps,
        sliding_window=max(w for w in c.layer_windows if w is not None),
        layer_types=["sliding_attention" if w is not None else "full_attention" for w in c.layer_windows],
        rope_parameters={
            "full_attention": {"rope_type": "default", "rope_theta": c.rope_theta},
            "sliding_attention": {"rope_type": "default", "rope_theta": c.rope_local_theta},
        },
        query_pre_attn_scalar=int(c.query_pre_attn_scalar)
        if float(c.query_pre_attn_scalar).is_integer()
        else c.query_pre_attn_scalar,
        max_position_embeddings=c.max_position_embeddings,
        tie_word_embeddings=True,
        attn_implementation="sdpa",
    )
    hf = transformers.Gemma3ForCausalLM(config).eval()
    missing, unexpected = hf.model.load_state_dict(model.state_dict(), strict=False)
    if unexpected or not all(m.endswith("embed_scale") for m in missing):
        raise ValueError(f"weights do not fit transformers' Gemma3: missing {missing}, unexpected {unexpected}")
    return hf


def check_gguf(path: str, model, prompt: list[int]) -> float:
    """Max abs difference of prefill logits between our model and transformers' own load of the
    GGUF file (its dequantization, names and config)."""
    from pathlib import Path

    import transformers

    from treeattn.models.attention import LocalAttention

    p = Path(path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(p.parent, gguf_file=p.name, dtype=torch.float32).eval()
    positions = torch.arange(len(prompt))[None]
    with torch.no_grad():
        ours = model.logits(model(torch.tensor([prompt]), positions, lambda layer, k, v: (k, v, positions), LocalAttention()))
        return float((ours - hf(torch.tensor([prompt])).logits).abs().max())


def oracle(model, prompt: list[int], new_tokens: int, timing_tokens: int) -> dict:
    """transformers on our weights: uncached greedy tokens, and cached time per token."""
    hf = transformers_twin(model)
    ids = list(prompt)
    start = time.perf_counter()
    with torch.no_grad():
        for _ in range(new_tokens):
            ids.append(int(hf(torch.tensor([ids]), logits_to_keep=1).logits[0, -1].argmax()))  # the last row only
    uncached_s = time.perf_counter() - start
    with torch.no_grad():
        t0 = time.perf_counter()
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=1, do_sample=False)
        t1 = time.perf_counter()
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=1 + timing_tokens, do_sample=False)
        t2 = time.perf_counter()
    # (t2 - t1) - (t1 - t0): the timing_tokens decode steps beyond the prefill and first token
    return dict(tokens=ids[len(prompt):], uncached_s=uncached_s, time_to_first_token_s=t1 - t0,
                time_per_token_s=max(0.0, (t2 - t1) - (t1 - t0)) / timing_tokens,
                cached_tokens=out[0, len(prompt):].tolist())


def step_summary(step_times: list[float]) -> dict:
    """ms per token of the decode steps after the first (median and min) and how many were counted."""
    import statistics

    steps = step_times[1:]
    return {"ms_per_token": 1e3 * statistics.median(steps), "min_ms": 1e3 * min(steps), "steps": len(steps)}


def timed_rank(rank: int, world_size: int, path: str, prompt: list[int], new_tokens: int) -> dict:
    """One rank of a timing run: the engine's greedy decode with ignore_eos, its step times. Each rank
    runs cores / ranks torch threads, as the engine's ranks do (more would oversubscribe the cores)."""
    import treeattn as ta

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    result = ta.generate(ta.load_model(path), prompt, max_new_tokens=new_tokens, ignore_eos=True)
    return {"tokens": result.generated_ids[0], "threads": torch.get_num_threads(), **step_summary(result.step_times_s)}


def transformers_timing(model, prompt: list[int], new_tokens: int, chunk: int = 2048) -> dict:
    """transformers' cached greedy decoding on our weights (sdpa, a DynamicCache built from the config, so
    the window layers keep only their window), one forward per token, each timed.

    The prompt is prefilled in `chunk`-token forwards through that cache: one 30K-token forward would
    compute every window layer's full 30K x 30K scores (~15 min here), which no decoder needs. The
    timed loop is the least a transformers user can run (no generate() bookkeeping)."""
    from transformers import DynamicCache

    hf = transformers_twin(model)
    cache = DynamicCache(config=hf.config)
    t0 = time.perf_counter()
    with torch.inference_mode():
        for start in range(0, len(prompt), chunk):
            logits = hf(input_ids=torch.tensor([prompt[start:start + chunk]]), past_key_values=cache, use_cache=True,
                        logits_to_keep=1).logits
        tokens = [int(logits[0, -1].argmax())]
        t1 = time.perf_counter()
        steps = []
        for _ in range(new_tokens - 1):
            a = time.perf_counter()
            logits = hf(input_ids=torch.tensor([[tokens[-1]]]), past_key_values=cache, use_cache=True).logits
            tokens.append(int(logits[0, -1].argmax()))
            steps.append(time.perf_counter() - a)
    return {"tokens": tokens, "threads": torch.get_num_threads(), "time_to_first_token_s": t1 - t0,
            "prefill_chunk": chunk, **step_summary(steps)}


def time_per_token(path: str, prompt: list[int], nprocs: list[int], new_tokens: int) -> dict:
    """Time per token of the engine on each rank count and of transformers, one prompt, one run."""
    import treeattn as ta

    rows = []
    for p in nprocs:
        rows.append({"name": f"treeattn, {p} rank{'s' if p > 1 else ''}", "nproc": p,
                     **ta.spawn(timed_rank, p, path, prompt, new_tokens, timeout=7200.0)[0]})
        print(json.dumps(rows[-1]), flush=True)
    rows.append({"name": "transformers (sdpa, cached)", "nproc": 1, **transformers_timing(ta.load_model(path), prompt,
                                                                                          new_tokens)})
    print(json.dumps(rows[-1]), flush=True)
    base = rows[-1]
    for row in rows:
        row["over_transformers"] = row["ms_per_token"] / base["ms_per_token"]
        row["same_tokens"] = row["tokens"] == base["tokens"]
    return {"rows": rows}


def main() -> None:
    parser = harness.parser(__doc__, context=8192, nproc=[1, 2], max_new_tokens=4)
    parser.add_argument("--timing-tokens", type=int, default=8, help="decode steps timed for transformers' cached decoding")
    parser.add_argument("--depth", type=float, default=0.5)
    parser.add_argument("--no-oracle", action="store_true")
    parser.add_argument("--timing", action="store_true", help="only: time per token of the engine on each --nproc and of "
                        "transformers' cached decoding, --max-new-tokens steps each (see the module doc)")
    parser.add_argument("--check-gguf", action="store_true", help="only: prefill logits of a short prompt against "
                        "transformers' own load of the GGUF file (minutes on a 2-core machine)")
    args = harness.parse_args(parser)

    import treeattn as ta
    from treeattn.eval.demo import gemma3_path
    from treeattn.eval.haystack import needle_case
    from treeattn.eval.runner import decode_methods
    from treeattn.models.loader import read_model_files

    path = str(gemma3_path())
    if args.check_gguf:
        model = ta.load_model(path)
        prompt = model.tokenizer.encode("The capital of France is Paris. The capital of Italy is").ids
        print(json.dumps(dict(prompt_tokens=len(prompt), max_abs_logit_difference=check_gguf(path, model, prompt))))
        return
    files = read_model_files(path)
    case = needle_case(files.tokenizer, None, context_tokens=args.context, depth=args.depth)
    report = dict(model=path, context=args.context, prompt_tokens=len(case.prompt_ids), answer=case.answer,
                  depth=case.actual_depth,
                  cores=os.cpu_count(), load_before=os.getloadavg(), runs=[])
    if args.timing:
        report.update(time_per_token(path, case.prompt_ids, args.nproc, args.max_new_tokens), load_after=os.getloadavg())
        for row in report["rows"]:
            print(f"| {report['prompt_tokens']} | {row['name']} | {row['threads']} | {row['ms_per_token']:.1f} "
                  f"({row['min_ms']:.1f}) | "
                  f"{row['over_transformers']:.2f}x | {row['same_tokens']} |")
        harness.write_output(args.output, report)
        return
    c = files.config
    report["full_cache_bytes_per_token"] = c.num_layers * 2 * c.num_kv_heads * c.head_dim * 4
    for p in args.nproc:
        runs, timing = decode_methods(path, [case.prompt_ids], ta.EngineConfig(nproc=p, device="cpu"),
                                      ta.SamplingParams(max_new_tokens=args.max_new_tokens), methods=(("tree", "onepass"),))
        r = runs[0][0].result
        positions = len(case.prompt_ids) + len(r.generated_ids[0])
        report["runs"].append(dict(nproc=p, tokens=r.generated_ids[0], text=files.tokenizer.decode(r.generated_ids[0]),
                                   kv_bytes_per_rank=r.kv_bytes_per_rank, kv_bytes_per_token=r.kv_bytes_per_token,
                                   kv_window_bytes=r.kv_window_bytes,
                                   full_cache_bytes_per_rank=positions * report["full_cache_bytes_per_token"] / p,
                                   time_to_first_token_s=r.prefill_s, time_per_token_s=r.decode_s / max(1, r.decode_steps),
                                   load_s=timing.load_s, total_s=timing.total_s))
        print(json.dumps(report["runs"][-1]), flush=True)
    if not args.no_oracle:
        model = ta.load_model(path)
        report["transformers"] = oracle(model, case.prompt_ids, args.max_new_tokens, args.timing_tokens)
        for run in report["runs"]:
            run["tokens_equal_transformers"] = run["tokens"] == report["transformers"]["tokens"]
        print(json.dumps(report["transformers"]), flush=True)
    report["load_after"] = os.getloadavg()
    harness.write_output(args.output, report)


if __name__ == "__main__":
    main()
