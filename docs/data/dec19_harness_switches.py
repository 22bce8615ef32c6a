"""Session 19 (dec19): docs/data/dec18_step.py with each step's voluntary context switches counted (all threads). Session 18 (dec18): one rank's decode step at a given context WITHOUT its prefill, timed and split.

    PYTHONPATH=src python3 docs/data/dec18_step.py MODEL --context 4096 8192 --steps 40 --rounds 3 [--split] [--ab NAME]

Builds the rank as `treeattn generate MODEL --nproc 1 --weight-format packed --kv-cache-dtype float16
--activation-format int8` does (engine.worker.rank.make_runner over generate's batch_config for a prompt of
CONTEXT - 12 tokens + 16 new ones: the same blocks per rank, arena, fused and packed weights, huge pages, warm-up), fills the KV
cache's blocks with random float16 keys and values (N(0, 1); the attention kernel's time does not depend on them),
then runs RankRunner.step on the plan of one decode token at position CONTEXT - 12 (the same slot rewritten every step),
greedy. Per round and context: `--steps` steps, wall and process CPU ms a step (process CPU counts numba's pool threads).
--split wraps the paged attention kernel (ops.cpu_decode.LayerCall.__call__), the packed products
(ops.packed_linear.kernel_matmul: the LM head, N*K >= PARALLEL_MIN_WEIGHTS, apart) and the sampling phase, and reports
each as wall / CPU ms a step; "rest" is the step's wall minus them (Python between the kernels, norms, RoPE, cache
writes). --ab NAME alternates arms of one change inside each round (see ARMS). One JSON line per (round, context, arm).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import treeattn  # noqa: F401  (first, as `treeattn generate` imports it)
import torch

ARMS = {
    # name: {arm: settings}; each arm's settings are applied before its block of steps
    "none": {"base": {}},
    "attn_threads": {"2": {}, "1": {"attention_threads": 1}},
    "splits": {"2/thread": {"splits_per_thread": 2}, "1/thread": {"splits_per_thread": 1}},
    "parallel_min": {"head only": {}, "all serial": {"parallel_min": 1 << 40}},
}


def sw():
    n = vol = 0
    for tid in os.listdir("/proc/self/task"):
        text = open(f"/proc/self/task/{tid}/status").read()
        n += 1
        vol += int(text.split("\nvoluntary_ctxt_switches:")[1].split()[0])
    return n, vol


def apply(settings: dict) -> None:
    from treeattn.ops import cpu_decode, packed_linear

    cpu_decode.SPLITS_PER_THREAD = settings.get("splits_per_thread", apply.splits_default)
    packed_linear.PARALLEL_MIN_WEIGHTS = settings.get("parallel_min", 1 << 22)
    apply.attention_threads = settings.get("attention_threads")


def main() -> None:
    from treeattn.ops import cpu_decode

    apply.splits_default = cpu_decode.SPLITS_PER_THREAD
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--context", type=int, nargs="+", default=[4096, 8192])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--activation-format", default="int8")
    ap.add_argument("--kv-cache-dtype", default="float16")
    ap.add_argument("--split", action="store_true")
    ap.add_argument("--kv-std", type=float, default=1.0, help="the random keys' and values' standard deviation")
    ap.add_argument("--ab", default="none", choices=sorted(ARMS))
    ap.add_argument("--in-thread", action="store_true", help="build and step the runner in a second thread, as the "
                    "engine's driver thread does (one rank: the steps run there)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from treeattn.cache.blocks import BlockRef
    from treeattn.engine.config import EngineConfig
    from treeattn.engine.generate import batch_config
    from treeattn.engine.request import SamplingParams
    from treeattn.engine.scheduler import Chunk, SampleSpec, StepPlan
    from treeattn.engine.worker.rank import make_runner
    from treeattn.models.loader import load_model
    from treeattn.ops import cpu_decode, packed_linear
    from treeattn.models import packed as packed_mod
    from treeattn.ops import paged_decode

    current: dict[str, list[float]] = {}

    def timed(name_of, fn):
        def wrapper(*a, **k):
            w0, c0 = time.perf_counter(), time.process_time()
            try:
                return fn(*a, **k)
            finally:
                c = current.setdefault(name_of(*a, **k), [0.0, 0.0])
                c[0] += time.perf_counter() - w0
                c[1] += time.process_time() - c0
        return wrapper

    if args.split:
        cpu_decode.LayerCall.__call__ = timed(lambda *a, **k: "attention", cpu_decode.LayerCall.__call__)

        def mm_name(x, fmt, qs, *a, **k):
            return "lm_head" if qs.shape[0] * qs.shape[1] * packed_linear.BLOCK >= (1 << 22) else "layer_matmuls"
        packed_linear.kernel_matmul = packed_mod.kernel_matmul = timed(mm_name, packed_linear.kernel_matmul)
    # the attention kernel's threads (arm "attn_threads"): the layout's, read when the step's LayerCall is made
    layout_init = paged_decode.PagedDecodeLayout.__init__

    def init(self, *a, threads=None, **k):
        layout_init(self, *a, threads=getattr(apply, "attention_threads", None) or threads, **k)
    paged_decode.PagedDecodeLayout.__init__ = init

    new = 16
    runners = {}
    for context in args.context:
        prompt = context - 12
        sampling = SamplingParams(max_new_tokens=new, ignore_eos=True, temperature=0.0)
        config = batch_config(EngineConfig(weight_format="packed", kv_cache_dtype=args.kv_cache_dtype,
                                           activation_format=args.activation_format), sampling, 1, [[0] * prompt], 1)
        model = load_model(args.model, dtype=torch.float32, device="cpu", weight_format="packed")
        runner = make_runner(model, config)
        g = torch.Generator().manual_seed(0)
        for layer in range(runner.cache.num_layers):
            for blocks in runner.cache.blocks(layer):
                blocks.copy_((args.kv_std * torch.randn(blocks.shape, generator=g)).to(blocks.dtype))
        nblocks = -(-(prompt + new) // config.block_size)
        chunk = Chunk(seq_id=0, tokens=(504,), start=prompt, blocks=tuple(BlockRef(0, i) for i in range(nblocks)),
                      sample=SampleSpec(temperature=0.0, top_k=0, top_p=1.0, seed=0))
        runners[context] = (runner, StepPlan(chunks=(chunk,)), nblocks)
    arms = ARMS[args.ab]
    for r in range(args.rounds):
        for context, (runner, plan, nblocks) in runners.items():
            for arm, settings in (arms.items() if r % 2 == 0 else reversed(list(arms.items()))):
                apply(settings)
                for _ in range(3):  # warm: the arm's first steps
                    runner.step(plan)
                totals: dict[str, list[float]] = {}
                walls, cpus, tokens = [], [], set()
                vols = []
                load = os.getloadavg()[0]
                for _ in range(args.steps):
                    current.clear()
                    runner._phases = {}
                    s0 = sw()
                    w0, c0 = time.perf_counter(), time.process_time()
                    out = runner.step(plan)
                    s1 = sw(); vols.append(s1[1]-s0[1]); nthreads = s1[0]
                    walls.append(time.perf_counter() - w0)
                    cpus.append(time.process_time() - c0)
                    tokens.add(tuple(out.tokens[0]))
                    for k, v in current.items():
                        t = totals.setdefault(k, [0.0, 0.0])
                        t[0] += v[0]
                        t[1] += v[1]
                    t = totals.setdefault("sampling", [0.0, 0.0])
                    t[0] += runner._phases.get("sampling", 0.0)
                n = args.steps
                walls_sorted = sorted(walls)
                rec = {"round": r, "context": context, "blocks": nblocks, "arm": arm, "steps": n,
                       "wall_ms_mean": round(1e3 * sum(walls) / n, 3), "wall_ms_median": round(1e3 * walls_sorted[n // 2], 3),
                       "cpu_ms_mean": round(1e3 * sum(cpus) / n, 3), "vol_switches_per_step": sum(vols)/n, "threads": nthreads, "tokens": sorted(tokens),
                       "load_before": round(load, 2), "load_after": round(os.getloadavg()[0], 2)}
                if args.split:
                    split = {k: [round(1e3 * v[0] / n, 3), round(1e3 * v[1] / n, 3)] for k, v in totals.items()}
                    split["rest"] = [round(rec["wall_ms_mean"] - sum(split[k][0] for k in split if k != "sampling"), 3), None]
                    rec["split_wall_cpu_ms"] = split
                print(json.dumps(rec), flush=True)


if __name__ == "__main__":
    import sys

    if "--in-thread" in sys.argv:
        import threading

        t = threading.Thread(target=main, name="driver")
        t.start()
        t.join()
    else:
        main()
