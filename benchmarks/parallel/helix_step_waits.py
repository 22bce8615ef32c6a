"""Where a decode step on 2 ranks waits: each rank's step time split into its compute, waiting for the
other rank at the shared-memory collectives (the ranks' imbalance, or a peer descheduled) and the
handshake's own latency, plus the gap between steps (rank 0: sampling's tail, the driver and the plan's
broadcast; the other ranks: waiting for the next plan).

    python benchmarks/models/make_llama_gguf.py --out /tmp/llama1b.Q4_0.gguf
    python benchmarks/parallel/helix_step_waits.py /tmp/llama1b.Q4_0.gguf --layouts tp2 tp1 seq --rounds 2

Every layout runs in a fresh pair of gloo ranks (ta.spawn), the engine built inside the group
(`ta.Engine(MODEL, tp=...)` on each rank, rank 0 driving), one prompt of --context random ids (the
weights are the step when it is short), --max-new-tokens greedy tokens. Each rank's process sets
SharedMemoryGroup.count_waits (treeattn.parallel.shared_memory.WaitStats: every rank publishes when it
arrived at each collective, so late_ns = the last arrival minus this rank's, handoff_ns = from the last
arrival to this rank seeing it) and wraps RankRunner.step to stamp each step's start and end. Only the
decode steps are counted; the wait at each step's first collective (the embedding's all-reduce: the other rank
starting the step late, e.g. rank 1 woken by the plan's broadcast) is also shown apart. The (layout, --spin-us) runs alternate
within each round (rotated by one between rounds).

    seq   the sequence-only layout (every rank all the weights; one combine a layer)
    tp1   Helix T=1 (KV split by sequence; MLP and LM head over both ranks; o_proj whole on each since session 22)
    tp2   Helix T=2 (heads, MLP and LM head split; no combine)
"""

from __future__ import annotations

import random
import time

import torch

from treeattn.bench import harness

LAYOUTS = {"seq": None, "tp1": 1, "tp2": 2}


def _rank(rank: int, world_size: int, model: str, tp, prompt: list[int], new_tokens: int, activation_format: str,
          spin_us: float) -> dict:
    import treeattn as ta
    from treeattn.engine.worker.runner import RankRunner
    from treeattn.parallel.shared_memory import SharedMemoryGroup, WaitStats

    torch.set_num_threads(1)
    SharedMemoryGroup.count_waits = True
    SharedMemoryGroup.spin_s = spin_us * 1e-6
    steps, totals, first_late = [], WaitStats(), []
    step, add = RankRunner.step, WaitStats.add
    log: list[int] = []  # every counted collective's late_ns, in order

    def logged_add(self, arrived: int, last: int, seen: int) -> None:
        log.append(last - arrived)
        add(self, arrived, last, seen)

    WaitStats.add = logged_add

    def groups(runner) -> list:
        found = [g for g in (runner.comm_group, runner.attention_group) if isinstance(g, SharedMemoryGroup)]
        return list({id(g): g for g in found}.values())

    def timed(self, plan):
        decoding = bool(plan.chunks) and all(c.decoding for c in plan.chunks)
        before = [(g.waits.calls, g.waits.late_ns, g.waits.handoff_ns) for g in groups(self)]
        start, first = time.perf_counter_ns(), len(log)
        out = step(self, plan)
        end = time.perf_counter_ns()
        if decoding:
            steps.append((start, end))
            first_late.append(log[first] if len(log) > first else 0)  # the step's first collective: the embedding's
            for g, (calls, late, handoff) in zip(groups(self), before):
                totals.calls += g.waits.calls - calls
                totals.late_ns += g.waits.late_ns - late
                totals.handoff_ns += g.waits.handoff_ns - handoff
        return out

    RankRunner.step = timed
    engine = ta.Engine(model, tp=tp, block_size=256, cache_tokens=len(prompt) + new_tokens + 256, weight_format="packed",
                       activation_format=activation_format)
    tokens = None
    if engine.is_driver:
        with engine:
            tokens = engine.generate([prompt], max_new_tokens=new_tokens, ignore_eos=True)[0].token_ids
    n = len(steps)
    busy = sum(e - s for s, e in steps)
    gaps = [steps[i + 1][0] - steps[i][1] for i in range(n - 1)]
    return {"rank": rank, "tokens": tokens, "decode_steps": n, "step_ms": busy / n / 1e6,
            "late_ms": totals.late_ns / n / 1e6, "handoff_ms": totals.handoff_ns / n / 1e6,
            "first_late_ms": sum(first_late) / n / 1e6,
            "collectives_per_step": totals.calls / n, "gap_ms": sum(gaps) / max(1, len(gaps)) / 1e6,
            "wall_ms_per_token": (steps[-1][1] - steps[0][0]) / (n - 1) / 1e6 if n > 1 else float("nan")}


def main() -> None:
    import treeattn as ta

    p = harness.parser(__doc__, model="required", context=8, max_new_tokens=64)
    p.add_argument("--layouts", nargs="+", default=["tp2", "tp1", "seq"], choices=list(LAYOUTS))
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--spin-us", type=float, nargs="+", default=[0.0],
                   help="SharedMemoryGroup.spin_s in microseconds: how long a waiting rank spins before it yields (one run each)")
    p.add_argument("--activation-format", default="float32", choices=["float32", "int8"],
                   help="how the packed weights multiply the activations (EngineConfig.activation_format)")
    args = harness.parse_args(p)
    rng = random.Random(0)
    prompt = [rng.randrange(100, 49000) for _ in range(args.context)]
    rows = []
    header = ("| layout | spin us | round | rank | load before | ms / step | of which: waiting for the peer | (at the first "
              "collective) | handoff | "
              "compute and the rest | gap between steps | wall ms / token | collectives / step |")
    lines = [header, "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    print(header, flush=True)
    for i in range(args.rounds):
        runs = [(layout, spin) for layout in args.layouts for spin in args.spin_us]
        for layout, spin in runs[i % len(runs):] + runs[: i % len(runs)]:
            load = open("/proc/loadavg").read().split()[0]
            for r in ta.spawn(_rank, 2, args.model, LAYOUTS[layout], prompt, args.max_new_tokens, args.activation_format, spin,
                              timeout=3600):
                r.update(layout=layout, round=i, load_before=load, spin_us=spin)
                rows.append(r)
                rest = r["step_ms"] - r["late_ms"] - r["handoff_ms"]
                line = (f"| {layout} | {spin:g} | {i} | {r['rank']} | {load} | {r['step_ms']:.1f} | {r['late_ms']:.1f} | "
                        f"{r['first_late_ms']:.2f} | "
                        f"{r['handoff_ms']:.2f} | "
                        f"{rest:.1f} | {r['gap_ms']:.2f} | {r['wall_ms_per_token']:.1f} | {r['collectives_per_step']:.0f} |")
                lines.append(line)
                print(line, flush=True)
    first = next(r["tokens"] for r in rows if r["tokens"] is not None)
    same = all(r["tokens"] == first for r in rows if r["tokens"] is not None)
    lines.append(f"greedy tokens equal across layouts and rounds: {same}")
    print(lines[-1])
    harness.write_output(args.output, rows, "\n".join(lines))


if __name__ == "__main__":
    main()
