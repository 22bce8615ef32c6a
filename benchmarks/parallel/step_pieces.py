"""Where a decode step's time goes on each rank, piece by piece, in thread CPU time and in wall time.

    python benchmarks/parallel/step_pieces.py MODEL --context 4096 --layouts one seq tp1 --rounds 2

Each layout runs the real engine (`ta.Engine` built inside a group of ta.spawn ranks, rank 0 driving; `one`: one
rank of 2 threads in a spawned process of its own), one prompt of --context random ids, --max-new-tokens greedy
tokens (--warmup decode steps left out). Every rank times, with time.thread_time_ns (its own thread's CPU: a
rank preempted by other processes does not count) and time.perf_counter_ns, nested pieces of every decode step;
each piece's figure excludes the pieces inside it:

    embed       the embedding lookup (and its all-reduce's own work: the vocabulary-split table)
    attn_proj   the attention block around the pieces below: q/k/v projection (fused), RoPE, views
    kv_store    the cache write of the step's keys and values
    attend      the paged attention kernel over this rank's shard
    combine     the onepass combine's own work (packing, the division)
    o_proj      the output projection (its column narrowing included)
    mlp         gate/up, activation, down_proj
    lm_head     the logits of this rank's share of the vocabulary
    sampling    the picks from the shares' maxima (or the full logits) on rank 0, the maxima elsewhere
    sync@X      a shared-memory collective called inside X: publishing, WAITING for the peer, reducing
    rest        the step's remainder: norms, residual adds, the plan's bookkeeping, module calls

Thread CPU inside a sync piece is the spin/yield loop's CPU; its wall time includes the time descheduled. One
process with 2 threads (`one`): its thread CPU is the main thread's (the matmuls' second thread is not in it);
`process_cpu_ms` is every thread's. Writes one JSON line a rank and layout (--output) and a table.
"""

from __future__ import annotations

import random
import time

import torch

from treeattn.bench import harness

LAYOUTS = {"one": (1, None), "seq": (2, None), "tp1": (2, 1), "tp2": (2, 2)}


class Pieces:
    """Exclusive thread-CPU and wall nanoseconds per piece name, for nested enter/exit pairs."""

    def __init__(self) -> None:
        self.cpu: dict[str, int] = {}
        self.wall: dict[str, int] = {}
        self.calls: dict[str, int] = {}
        self.stack: list[list] = []  # [name, cpu0, wall0, child_cpu, child_wall]
        self.on = False

    def enter(self, name: str) -> None:
        if self.on:
            if name == "sync" and self.stack:
                name = "sync@" + self.stack[-1][0]
            self.stack.append([name, time.thread_time_ns(), time.perf_counter_ns(), 0, 0])

    def exit(self) -> None:
        if self.on and self.stack:
            cpu, wall = time.thread_time_ns(), time.perf_counter_ns()
            name, c0, w0, cc, cw = self.stack.pop()
            self.cpu[name] = self.cpu.get(name, 0) + (cpu - c0 - cc)
            self.wall[name] = self.wall.get(name, 0) + (wall - w0 - cw)
            self.calls[name] = self.calls.get(name, 0) + 1
            if self.stack:
                self.stack[-1][3] += cpu - c0
                self.stack[-1][4] += wall - w0


def _wrap(owner, attr: str, name: str, pieces: Pieces) -> None:
    original = getattr(owner, attr)

    def wrapped(*args, **kwargs):
        pieces.enter(name)
        try:
            return original(*args, **kwargs)
        finally:
            pieces.exit()

    setattr(owner, attr, wrapped)


def _hook(module, name: str, pieces: Pieces) -> None:
    module.register_forward_pre_hook(lambda m, a: pieces.enter(name), prepend=True)
    module.register_forward_hook(lambda m, a, o: pieces.exit())


def _instrument(pieces: Pieces) -> None:
    from treeattn.engine.worker.batch import PagedBatch
    from treeattn.engine.worker.runner import RankRunner
    from treeattn.parallel.shared_memory import SharedMemoryGroup

    for cls, attr, name in ((PagedBatch, "kv_store", "kv_store"), (PagedBatch, "attend", "attend"),
                            (PagedBatch, "_combine", "combine"), (RankRunner, "_outcome", "sampling"),
                            (SharedMemoryGroup, "all_reduce", "sync"), (SharedMemoryGroup, "all_gather", "sync")):
        _wrap(cls, attr, name, pieces)
    PagedBatch.__call__ = PagedBatch.kv_store
    make = RankRunner._groups

    def groups(self, *args, **kwargs):  # after connect(): the model's hooks are in place, ours go after them
        out = make(self, *args, **kwargs)
        model = self.model
        for layer in model.layers:
            _hook(layer.self_attn, "attn_proj", pieces)
            _hook(layer.self_attn.o_proj, "o_proj", pieces)
            _hook(layer.mlp, "mlp", pieces)
        _hook(model.embed_tokens, "embed", pieces)
        _wrap(model, "logits", "lm_head", pieces)
        return out

    RankRunner._groups = groups


def _rank(rank: int, world_size: int, model: str, tp, threads: int, prompt: list[int], new_tokens: int, warmup: int,
          activation_format: str, kv_cache_dtype: str) -> dict:
    import treeattn as ta
    from treeattn.engine.worker.runner import RankRunner

    torch.set_num_threads(threads)
    pieces = Pieces()
    _instrument(pieces)
    step, steps = RankRunner.step, []

    def timed(self, plan):
        decoding = bool(plan.chunks) and all(c.decoding for c in plan.chunks)
        if decoding:
            steps.append(None)
        counted = decoding and len(steps) > warmup
        pieces.on = counted
        cpu, proc, wall = time.thread_time_ns(), time.process_time_ns(), time.perf_counter_ns()
        pieces.enter("rest")
        try:
            return step(self, plan)
        finally:
            pieces.exit()
            pieces.on = False
            if counted:
                steps[-1] = (time.thread_time_ns() - cpu, time.process_time_ns() - proc, time.perf_counter_ns() - wall, wall)

    RankRunner.step = timed
    engine = ta.Engine(model, nproc=world_size, tp=tp, threads_per_rank=threads, block_size=256,
                       cache_tokens=len(prompt) + new_tokens + 256, weight_format="packed",
                       activation_format=activation_format, kv_cache_dtype=kv_cache_dtype)
    tokens = None
    if engine.is_driver:
        with engine:
            tokens = engine.generate([prompt], max_new_tokens=new_tokens, ignore_eos=True)[0].token_ids
    timed_steps = [s for s in steps if s is not None]
    n = len(timed_steps)
    starts = [s[3] for s in timed_steps]
    return {"rank": rank, "tokens": tokens, "steps": n,
            "cpu_ms": {k: v / n / 1e6 for k, v in sorted(pieces.cpu.items())},
            "wall_ms": {k: v / n / 1e6 for k, v in sorted(pieces.wall.items())},
            "calls_per_step": {k: v / n for k, v in sorted(pieces.calls.items())},
            "step_cpu_ms": sum(s[0] for s in timed_steps) / n / 1e6,
            "process_cpu_ms": sum(s[1] for s in timed_steps) / n / 1e6,
            "step_wall_ms": sum(s[2] for s in timed_steps) / n / 1e6,
            "wall_ms_per_token": (starts[-1] - starts[0]) / (n - 1) / 1e6 if n > 1 else float("nan")}


PIECES = ("embed", "attn_proj", "kv_store", "attend", "combine", "sync@combine", "o_proj", "sync@o_proj", "mlp",
          "sync@mlp", "lm_head", "sampling", "sync@sampling", "sync@embed", "rest")


def _line(r: dict, key: str) -> str:
    cells = " | ".join(f"{r[key].get(p, 0.0):.2f}" for p in PIECES)
    total = r["step_cpu_ms"] if key == "cpu_ms" else r["step_wall_ms"]
    return f"| {r['layout']} | {r['round']} | {r['rank']} | {r['load_before']} | {key[:-3]} | {total:.2f} | {cells} |"


def main() -> None:
    import treeattn as ta

    p = harness.parser(__doc__, model="required", context=4096, max_new_tokens=16)
    p.add_argument("--layouts", nargs="+", default=["one", "seq", "tp1"], choices=list(LAYOUTS))
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--warmup", type=int, default=2, help="decode steps left out of the figures")
    p.add_argument("--label", default="", help="a name for this source tree in the rows (A/B runs)")
    p.add_argument("--activation-format", default="int8", choices=["float32", "int8"])
    p.add_argument("--kv-cache-dtype", default="float16")
    args = harness.parse_args(p)
    rng = random.Random(0)
    prompt = [rng.randrange(100, 49000) for _ in range(args.context - args.max_new_tokens)]
    header = ("| layout | round | rank | load | clock | step | " + " | ".join(PIECES) + " |")
    lines = [header, "|" + "---|" * (6 + len(PIECES))]
    print(header, flush=True)
    rows = []
    for i in range(args.rounds):
        order = args.layouts[i % len(args.layouts):] + args.layouts[: i % len(args.layouts)]
        for layout in order:
            nproc, tp = LAYOUTS[layout]
            load = open("/proc/loadavg").read().split()[0]
            threads = 2 if nproc == 1 else 1
            for r in ta.spawn(_rank, nproc, args.model, tp, threads, prompt, args.max_new_tokens, args.warmup,
                              args.activation_format, args.kv_cache_dtype, timeout=3600):
                r.update(layout=layout, round=i, load_before=load, label=args.label)
                rows.append(r)
                for key in ("cpu_ms", "wall_ms"):
                    lines.append(_line(r, key))
                    print(lines[-1], flush=True)
                lines.append(f"|   process CPU {r['process_cpu_ms']:.2f} ms a step; wall between steps "
                             f"{r['wall_ms_per_token']:.2f} ms a token; tokens {r['tokens'][:6] if r['tokens'] else '-'} |")
                print(lines[-1], flush=True)
    first = next(r["tokens"] for r in rows if r["tokens"] is not None)
    lines.append(f"greedy tokens equal across layouts and rounds: {all(r['tokens'] == first for r in rows if r['tokens'])}")
    print(lines[-1])
    harness.write_output(args.output, rows, "\n".join(lines))


if __name__ == "__main__":
    main()
