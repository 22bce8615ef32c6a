"""CPU time per decode step of ta.Engine (issue #50, step50): every process's CPU (this one and its
rank children, psutil user+system) over the N decode steps after the first token of a
streamed request (prompt cached by a first call), divided by N; wall time beside it. Robust to other load on the host (CPU, not wall).

    PYTHONPATH=$PWD/src python3 docs/data/step50_cpu_step.py MODEL NPROC CONTEXT N REPEATS [key=value ...]

key=value: EngineConfig fields (kv_cache_dtype=float16 activation_format=int8). With SPY=path set,
writes this process's pid to that path after the prefill and sleeps 3 s (for py-spy to attach).
"""
import os
import random
import sys
import time

import psutil
import treeattn as ta


def cpu_seconds() -> float:
    me = psutil.Process()
    total = 0.0
    for p in [me] + me.children(recursive=True):
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return total


def main() -> None:
    path, nproc, ctx, n, repeats = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
    extra = {k: int(v) if v.isdigit() else v for k, v in (a.split("=") for a in sys.argv[6:])}
    rng = random.Random(0)
    ids = [1] + [rng.randrange(100, 20000) for _ in range(ctx - 1)]
    with ta.Engine(path, nproc=nproc, weight_format="packed", **extra) as e:
        e.generate([ids], max_new_tokens=2, temperature=0.0, ignore_eos=True)
        if os.environ.get("SPY"):
            open(os.environ["SPY"], "w").write(str(os.getpid()))
            time.sleep(3)
        for _ in range(repeats):
            tokens = []
            for event in e.stream(ids, max_new_tokens=n + 1, temperature=0.0, ignore_eos=True):
                if event.token_id is None:
                    continue
                tokens.append(event.token_id)
                if len(tokens) == 1:  # the prompt's prefill is done: time the n decode steps after it
                    c0, w0 = cpu_seconds(), time.perf_counter()
            c1, w1 = cpu_seconds(), time.perf_counter()
            print(f"cpu_ms_per_step {(c1 - c0) / n * 1e3:.2f} wall_ms_per_step {(w1 - w0) / n * 1e3:.2f} "
                  f"tokens {tokens[:12]} load {open('/proc/loadavg').read().split()[0]}", flush=True)


if __name__ == "__main__":  # the ranks' forkserver imports this file: run only as the script
    main()
