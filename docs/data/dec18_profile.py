"""Session 18 (dec18): where one decode step's time goes on ONE rank, as `treeattn generate` runs it.

    PYTHONPATH=src python3 docs/data/dec18_profile.py MODEL --context 4096 --activation-format int8 --threads 2

The same job as `benchmarks/models/weight_format.py ... --nproc 1` (the needle prompt, weights packed, float16 KV,
batch_config's cache sizing, generate_rank's Generation), with timers wrapped around the calls that make a step:
the paged attention kernel (ops.cpu_decode.LayerCall.__call__), the packed products (ops.packed_linear.kernel_matmul,
split into the LM head, N*K >= PARALLEL_MIN_WEIGHTS, and the layers' smaller ones), and the engine's own step and
sampling phases. Each bucket: wall ms and process CPU ms a decode step (process CPU counts numba's pool threads),
mean over the decode steps after the first 2. The timers add a few us a call; "rest" is the step minus the buckets
(Python between kernels, norms, RoPE, cache writes, embedding). Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--activation-format", default="int8")
    ap.add_argument("--kv-cache-dtype", default="float16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-timers", action="store_true", help="only the step times (no wrapped calls)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from treeattn.engine.config import EngineConfig
    from treeattn.engine.generate import Generation, batch_config
    from treeattn.engine.request import SamplingParams
    from treeattn.engine.worker import runner as runner_mod
    from treeattn.eval.haystack import needle_case
    from treeattn.models import packed as packed_mod
    from treeattn.models.loader import load_model, read_model_files
    from treeattn.ops import cpu_decode, packed_linear

    files = read_model_files(args.model)
    case = needle_case(files.tokenizer, files.chat_template, context_tokens=args.context, depth=0.5, seed=0)
    prompts = [list(case.prompt_ids)]
    sampling = SamplingParams(max_new_tokens=args.max_new_tokens, ignore_eos=True, temperature=0.0)
    config = EngineConfig(weight_format="packed", kv_cache_dtype=args.kv_cache_dtype, activation_format=args.activation_format)
    config = batch_config(config, sampling, 1, prompts, 1)
    model = load_model(args.model, dtype=torch.float32, device="cpu", weight_format="packed")

    steps: list[dict] = []
    current: dict[str, list[float]] = {}

    def add(name, wall, cpu):
        c = current.setdefault(name, [0.0, 0.0, 0])
        c[0] += wall
        c[1] += cpu
        c[2] += 1

    def timed(name_of, fn):
        def wrapper(*a, **k):
            w0, c0 = time.perf_counter(), time.process_time()
            try:
                return fn(*a, **k)
            finally:
                add(name_of(*a, **k), time.perf_counter() - w0, time.process_time() - c0)
        return wrapper

    if not args.no_timers:
        orig_call = cpu_decode.LayerCall.__call__
        cpu_decode.LayerCall.__call__ = timed(lambda *a, **k: "attention_kernel", orig_call)
        orig_mm = packed_linear.kernel_matmul

        def mm_name(x, fmt, qs, *a, **k):
            n, kk = qs.shape[0], qs.shape[1] * packed_linear.BLOCK
            return "lm_head" if n * kk >= packed_linear.PARALLEL_MIN_WEIGHTS else "layer_matmuls"
        packed_linear.kernel_matmul = timed(mm_name, orig_mm)
        packed_mod.kernel_matmul = packed_linear.kernel_matmul
    orig_step = runner_mod.RankRunner.step

    def step(self, plan):
        current.clear()
        w0, c0 = time.perf_counter(), time.process_time()
        out = orig_step(self, plan)
        wall, cpu = time.perf_counter() - w0, time.process_time() - c0
        decoding = bool(plan.chunks) and all(c.decoding for c in plan.chunks)
        if decoding:
            rec = {k: tuple(v) for k, v in current.items()}
            rec["step"] = (wall, cpu, 1)
            rec["sampling_phase"] = (self._phases.get("sampling", 0.0), 0.0, 1)
            rec["attention_phase"] = (self._phases.get("attention", 0.0), 0.0, 1)
            steps.append(rec)
        return out
    runner_mod.RankRunner.step = step

    start = time.perf_counter()
    run = Generation(model, prompts, config, sampling)
    for _ in run:
        pass
    result = run.result
    kept = steps[2:] or steps
    names = sorted({k for s in kept for k in s})
    summary = {}
    for name in names:
        vals = [s.get(name, (0.0, 0.0, 0)) for s in kept]
        summary[name] = {"wall_ms": round(1e3 * sum(v[0] for v in vals) / len(vals), 3),
                         "cpu_ms": round(1e3 * sum(v[1] for v in vals) / len(vals), 3),
                         "calls": sum(v[2] for v in vals) / len(vals)}
    measured = sum(summary[n]["wall_ms"] for n in ("attention_kernel", "lm_head", "layer_matmuls") if n in summary)
    summary["rest"] = {"wall_ms": round(summary["step"]["wall_ms"] - measured, 3)}
    step_walls = [round(1e3 * s["step"][0], 2) for s in steps]
    print(json.dumps({"context": args.context, "prompt_tokens": len(case.prompt_ids), "threads": args.threads,
                      "activation_format": args.activation_format, "timers": not args.no_timers,
                      "ms_per_token": round(1e3 * result.time_per_token_s, 3), "prefill_s": round(result.prefill_s, 2),
                      "tokens": result.generated_ids[0],
                      "summary": summary, "step_walls_ms": step_walls, "total_s": round(time.perf_counter() - start, 1),
                      "load": os.getloadavg()}))


if __name__ == "__main__":
    main()
