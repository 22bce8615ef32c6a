"""CPU time per decode step in each rank of a real 2-rank ta.Engine (issue #47, session 16), old code against new,
side by side: settles whether a layout slowed down without trusting wall clocks on a loaded 2-core host.

    python3 docs/data/helix47_rank_cpu_ab.py MODEL --src OLD/src NEW/src --layouts seq tp2 --rounds 3 \
        --context 4096 --new 24 --repeats 2 --set kv_cache_dtype=float16 activation_format=int8

Each round runs, for every layout in turn, one child process of this script per --src AT ONCE (so old and
new code see the same load, memory traffic and time), each with PYTHONPATH=SRC: it starts ta.Engine(MODEL,
nproc=2, tp=..., threads_per_rank=1, weight_format="packed", sized for one --context sequence as `treeattn
generate` sizes it, key=value...), prefills a --context prompt of
random ids once (the prefix cache keeps it), then --repeats times streams --new + 1 greedy tokens of the same
prompt (the prompt's last block is prefilled again, then --new decode steps) and reports each rank's figures
over those decode steps.

In every rank (this file is imported by the ranks' fork server, so the two patches below apply there too)
RankRunner.step and SharedMemoryGroup._wait are wrapped: a decode step's thread CPU time (time.thread_time_ns:
preemption by other processes does not count), the part of it spent inside the collectives' waits (spinning
and sched_yield: CPU a rank burns only because its peer is late) and its wall time go to one line a step of
a file per rank. "work" = step CPU - wait CPU: what the rank computes, the figure compared. RankRunner._outcome
is wrapped too: "outcome_work" is the part of "work" spent there (the LM head's share of the vocabulary, the
logits' gather, rank 0's sampling).
"""

import json
import os
import random
import statistics
import subprocess
import sys
import time

STEPS_DIR = os.environ.get("HELIX47_STEPS_DIR")


def _patch() -> None:
    """Wrap RankRunner.step and SharedMemoryGroup._wait (in this process: the driver, or a rank)."""
    from treeattn.engine.worker.runner import RankRunner
    from treeattn.parallel.shared_memory import SharedMemoryGroup

    waited, outcome_ns = [0], [0]
    wait, step, outcome = SharedMemoryGroup._wait, RankRunner.step, RankRunner._outcome

    def timed_wait(self, sequence):
        start = time.thread_time_ns()
        try:
            return wait(self, sequence)
        finally:
            waited[0] += time.thread_time_ns() - start

    def timed_outcome(self, *args, **kwargs):  # the LM head's share, the logits' gather, sampling
        w0, c0 = waited[0], time.thread_time_ns()
        try:
            return outcome(self, *args, **kwargs)
        finally:
            outcome_ns[0] += time.thread_time_ns() - c0 - (waited[0] - w0)

    def timed_step(self, plan):
        decoding = bool(plan.chunks) and all(c.decoding for c in plan.chunks)
        o0, w0, c0, t0 = outcome_ns[0], waited[0], time.thread_time_ns(), time.perf_counter_ns()
        out = step(self, plan)
        c1, t1 = time.thread_time_ns(), time.perf_counter_ns()
        if decoding:
            with open(os.path.join(STEPS_DIR, f"rank{self.rank}.txt"), "a") as f:
                f.write(f"{c1 - c0} {waited[0] - w0} {t1 - t0} {outcome_ns[0] - o0}\n")
        return out

    SharedMemoryGroup._wait = timed_wait
    if STEPS_DIR is not None:
        RankRunner.step, RankRunner._outcome = timed_step, timed_outcome


if STEPS_DIR:
    _patch()


def _read(path: str) -> list[tuple[int, int, int]]:
    if not os.path.exists(path):
        return []
    return [tuple(map(int, line.split())) for line in open(path)]


def child(model: str, layout: str, context: int, new: int, repeats: int, extra: dict) -> None:
    """One engine, one layout: print one JSON line per repeat with each rank's mean CPU per decode step."""
    import treeattn as ta

    rng = random.Random(0)
    ids = [rng.randrange(100, 49000) for _ in range(context - new - 1)]
    tp = {"seq": None, "tp1": 1, "tp2": 2}[layout]
    # sized as `treeattn generate` sizes one sequence (engine.generate.batch_config): the contiguous placement then
    # gives each KV rank half the sequence (ta.Engine's default cache_tokens, 32768, would leave a 4K one on rank 0)
    sized = {"max_batch_size": 1, "max_context": context, "cache_tokens": -(-context // 512) * 512, **extra}
    with ta.Engine(model, nproc=2, tp=tp, threads_per_rank=1, weight_format="packed", **sized) as e:
        e.generate([ids], max_new_tokens=2, temperature=0.0, ignore_eos=True)
        for _ in range(repeats):
            time.sleep(0.5)
            before = {r: len(_read(os.path.join(STEPS_DIR, f"rank{r}.txt"))) for r in range(2)}
            w0, tokens = time.perf_counter(), []
            for event in e.stream(ids, max_new_tokens=new + 1, temperature=0.0, ignore_eos=True):
                if event.token_id is not None:
                    tokens.append(event.token_id)
                    if len(tokens) == 1:
                        w0 = time.perf_counter()
            wall = (time.perf_counter() - w0) / new * 1e3
            time.sleep(0.5)  # the other rank's last line
            record = {"wall_ms_per_token": round(wall, 2), "tokens": tokens[:8], "load": open("/proc/loadavg").read().split()[0]}
            for r in range(2):
                steps = _read(os.path.join(STEPS_DIR, f"rank{r}.txt"))[before[r]:]
                record[f"rank{r}"] = {"steps": len(steps),
                                      "cpu_ms": round(statistics.fmean(s[0] for s in steps) / 1e6, 2),
                                      "wait_cpu_ms": round(statistics.fmean(s[1] for s in steps) / 1e6, 2),
                                      "work_ms": round(statistics.fmean(s[0] - s[1] for s in steps) / 1e6, 2),
                                      "wall_ms": round(statistics.fmean(s[2] for s in steps) / 1e6, 2),
                                      "outcome_work_ms": round(statistics.fmean(s[3] for s in steps) / 1e6, 2)}
            print(json.dumps(record), flush=True)


def driver(argv: list[str]) -> None:
    import argparse
    import tempfile

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="EngineConfig fields")
    p.add_argument("--src", nargs="+", required=True, help="src folders to alternate (PYTHONPATH of each child)")
    p.add_argument("--layouts", nargs="+", default=["seq", "tp2"], choices=["seq", "tp1", "tp2"])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--new", type=int, default=24)
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args(argv)
    print(f"# {' '.join(sys.argv)}\n# {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}", flush=True)
    for i in range(args.rounds):
        for layout in args.layouts:  # every --src at once: the same machine, load and memory traffic for each
            with tempfile.TemporaryDirectory() as tmp:
                children = []
                for j, src in enumerate(args.src):
                    steps = os.path.join(tmp, str(j))
                    os.mkdir(steps)
                    env = dict(os.environ, PYTHONPATH=src, HELIX47_STEPS_DIR=steps)
                    cmd = [sys.executable, __file__, "--child", args.model, layout, str(args.context), str(args.new),
                           str(args.repeats), *args.set]
                    children.append((src, subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                                           text=True)))
                for src, child_process in children:
                    out, err = child_process.communicate()
                    if child_process.returncode:
                        print(f"# round {i} {layout} {src}: failed {child_process.returncode}: {err[-1500:]}", flush=True)
                        continue
                    for line in out.splitlines():
                        print(json.dumps({"round": i, "layout": layout, "src": src, **json.loads(line)}), flush=True)

if __name__ == "__main__":  # the ranks' fork server imports this file: run only as the script
    if sys.argv[1:2] == ["--child"]:
        m, lay, ctx, n, reps, *kv = sys.argv[2:]
        child(m, lay, int(ctx), int(n), int(reps), {k: int(v) if v.isdigit() else v for k, v in (a.split("=") for a in kv)})
    else:
        driver(sys.argv[1:])
