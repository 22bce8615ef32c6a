"""Session 19 (dec19): every decode step of the REAL path (`treeattn generate --json`, prefill first), timed one by one.

    PYTHONPATH=src python3 docs/data/dec19_steps.py MODEL --context 4096 --activation-format int8 [--split] [--rounds N]
        [--ab NAME] [-- extra generate flags]

Runs `treeattn generate MODEL --prompt-ids IDS --max-new-tokens N --ignore-eos --nproc 1 --weight-format packed
--kv-cache-dtype float16 --activation-format A --json` in this process (the CLI's own main(), so its config, threads and
driver thread are the real ones), IDS the needle prompt weight_format.py builds (treeattn.eval.haystack, depth 0.5,
seed 0). RankRunner.step is wrapped to record, for every step, its wall time, the process CPU (numba's pool threads
included) and the calling thread's CPU; --split also wraps the paged attention kernel (ops.cpu_decode.LayerCall), the
packed products (ops.packed_linear.kernel_matmul, the LM head apart) as docs/data/dec18_step.py does. One JSON line per
decode step, then a summary per run: the mean of all decode steps (what time_per_token_s reports), of the steps after
the first, the median, and the JSON's own time_per_token_s. --ab NAME runs arms of one setting alternately, one
subprocess a run (so each arm's process starts fresh, as weight_format.py's runs do).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import subprocess
import sys
import time

ARMS = {
    "none": {"base": {}},
    # environment of the run (read at process start)
    "spin": {"default": {}, "spin10k": {"env": {"GOMP_SPINCOUNT": "10000"}}},
    # the OpenMP pools: libgomp throttles every pool's spin to 1,000 once it manages more threads than CPUs (a second
    # master thread: the engine's driver thread beside the main thread that built and warmed the rank)
    "pools": {"default": {}, "pause_main": {"env": {"DEC19_PAUSE_MAIN": "1"}},
              "active30k": {"env": {"OMP_WAIT_POLICY": "active", "GOMP_SPINCOUNT": "30000"}},
              "active300k": {"env": {"OMP_WAIT_POLICY": "active", "GOMP_SPINCOUNT": "300000"}}},
    # dec19's change (engine.transport.GroupChannel releases the building thread's pool) off and on
    "release": {"without": {"env": {"DEC19_NO_RELEASE": "1"}}, "with": {}},
}


def run_one(args, extra: list[str]) -> None:
    """In this process: the CLI's generate with RankRunner.step (and --split the kernels) wrapped."""
    import treeattn  # noqa: F401
    from treeattn.engine.worker import runner as runner_mod
    from treeattn.ops import cpu_decode, packed_linear
    from treeattn.models import packed as packed_mod

    current: dict[str, list[float]] = {}
    steps: list[dict] = []

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
    step = runner_mod.RankRunner.step
    last_end = [None]

    def switches() -> tuple[int, int, int]:
        """(threads, voluntary, involuntary context switches) summed over this process's threads."""
        n = vol = inv = 0
        for tid in os.listdir("/proc/self/task"):
            try:
                text = open(f"/proc/self/task/{tid}/status").read()
            except OSError:
                continue
            n += 1
            vol += int(text.split("voluntary_ctxt_switches:")[1].split()[0])
            inv += int(text.split("nonvoluntary_ctxt_switches:")[1].split()[0])
        return n, vol, inv

    def wrapped(self, plan):
        decoding = bool(plan.chunks) and all(c.decoding for c in plan.chunks)
        current.clear()
        s0 = switches() if decoding else None
        w0, c0, t0 = time.perf_counter(), time.process_time(), time.thread_time()
        gap = None if last_end[0] is None else w0 - last_end[0]
        try:
            return step(self, plan)
        finally:
            w1 = time.perf_counter()
            last_end[0] = w1
            if decoding:
                s1 = switches()
                rec = {"i": len(steps), "wall_ms": 1e3 * (w1 - w0), "cpu_ms": 1e3 * (time.process_time() - c0),
                       "thread_cpu_ms": 1e3 * (time.thread_time() - t0), "gap_before_ms": None if gap is None else 1e3 * gap,
                       "sampling_ms": 1e3 * getattr(self, "_phases", {}).get("sampling", 0.0),
                       "threads": s1[0], "vol_switches": s1[1] - s0[1], "invol_switches": s1[2] - s0[2]}
                for k, v in current.items():
                    rec[k + "_ms"] = [1e3 * v[0], 1e3 * v[1]]
                steps.append(rec)
    runner_mod.RankRunner.step = wrapped
    from treeattn.engine import transport

    released = []
    if os.environ.get("DEC19_NO_RELEASE"):  # the baseline: GroupChannel keeps the building thread's pool
        transport.release_thread_pool = lambda: False
    else:  # the change, with the process's thread count before and after it
        release = transport.release_thread_pool

        def counted():
            before = len(os.listdir("/proc/self/task"))
            done = release()
            released.append({"released": done, "threads_before": before, "threads_after": len(os.listdir("/proc/self/task"))})
            return done
        transport.release_thread_pool = counted
    if os.environ.get("DEC19_PAUSE_MAIN"):  # free the main thread's OpenMP pool before the driver thread starts
        import ctypes

        import torch
        from treeattn.engine import driver as driver_mod

        gomp = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libgomp.so.1"))
        init = driver_mod.Driver.__init__

        def paused(self, *a, **k):
            gomp.omp_pause_resource_all(2)  # omp_pause_hard
            init(self, *a, **k)
        driver_mod.Driver.__init__ = paused

    from treeattn.cli import app

    argv = ["generate", args.model, "--prompt-ids", args.ids, "--max-new-tokens", str(args.max_new_tokens), "--ignore-eos",
            "--nproc", "1", "--weight-format", "packed", "--kv-cache-dtype", args.kv_cache_dtype,
            "--activation-format", args.activation_format, "--json", *extra]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            app(argv, standalone_mode=False)
        except SystemExit:
            pass
    report = json.loads(out.getvalue().strip().splitlines()[-1])
    for rec in steps:
        print(json.dumps({k: (round(v, 3) if isinstance(v, float) else [round(x, 3) for x in v] if isinstance(v, list) else v)
                          for k, v in rec.items()}))
    walls = [r["wall_ms"] for r in steps]
    cpus = [r["cpu_ms"] for r in steps]
    print(json.dumps({"summary": True, "steps": len(walls), "time_per_token_ms_json": round(1e3 * report["timings"]["time_per_token_s"], 3),
                      "mean_all_ms": round(sum(walls) / len(walls), 3), "mean_after_first_ms": round(sum(walls[1:]) / (len(walls) - 1), 3),
                      "median_ms": round(sorted(walls)[len(walls) // 2], 3), "first_ms": round(walls[0], 3),
                      "cpu_mean_all_ms": round(sum(cpus) / len(cpus), 3), "cpu_mean_after_first_ms": round(sum(cpus[1:]) / (len(cpus) - 1), 3),
                      "prefill_s": round(report["timings"]["prefill_s"], 3), "tokens": report["generated_ids"], "release": released,
                      "load": os.getloadavg()[0]}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--activation-format", default="int8")
    ap.add_argument("--kv-cache-dtype", default="float16")
    ap.add_argument("--split", action="store_true")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--ab", default="none", choices=sorted(ARMS))
    ap.add_argument("--ids", default=None, help="(internal) the prompt ids file: run one generate in this process")
    args, extra = ap.parse_known_args()
    extra = [x for x in extra if x != "--"]
    if args.ids is not None:
        run_one(args, extra)
        return
    from treeattn.eval.haystack import needle_case
    from treeattn.models.loader import read_model_files

    files = read_model_files(args.model)
    case = needle_case(files.tokenizer, files.chat_template, context_tokens=args.context, depth=0.5, seed=0)
    ids = f"/tmp/dec19_ids_{os.getpid()}.json"
    with open(ids, "w") as f:
        json.dump(case.prompt_ids, f)
    print(f"# {' '.join(sys.argv)}; prompt {len(case.prompt_ids)} tokens; load {os.getloadavg()}", flush=True)
    arms = ARMS[args.ab]
    for r in range(args.rounds):
        for arm, settings in (arms.items() if r % 2 == 0 else reversed(list(arms.items()))):
            cmd = [sys.executable, __file__, args.model, "--ids", ids, "--max-new-tokens", str(args.max_new_tokens),
                   "--activation-format", args.activation_format, "--kv-cache-dtype", args.kv_cache_dtype,
                   *(["--split"] if args.split else []), *settings.get("args", []), *extra]
            print(f"# round {r} arm {arm} load {os.getloadavg()[0]:.2f}", flush=True)
            done = subprocess.run(cmd, env={**os.environ, **settings.get("env", {})}, capture_output=True, text=True)
            if done.returncode:
                print(done.stderr[-3000:])
                raise SystemExit(done.returncode)
            for line in done.stdout.splitlines():
                print(json.dumps({"round": r, "arm": arm, **json.loads(line)}) if line.startswith("{") else line, flush=True)
    os.unlink(ids)


if __name__ == "__main__":
    main()
