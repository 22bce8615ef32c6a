"""Where the seconds of a `treeattn serve` start-up go: a timeline of each process (server and ranks).

    flock /tmp/treeattn-quiet.lock python benchmarks/serving/serve_timeline.py [MODEL] [--nproc 2] [--repeats 1] [--before DIR]

Starts `python -m treeattn serve MODEL --nproc N --port 0 --log-level debug` with a temporary
sitecustomize.py first on PYTHONPATH (spawned ranks inherit it). In every process it records, into
one events file: the interpreter's start (sitecustomize runs as `site` is imported), when the first
(outermost) `import torch` / `fastapi` / `uvicorn` statement returns, and every DEBUG+ record of the "treeattn"
loggers (the server's and the ranks' start-up steps), each with its wall-clock time and pid. The
script times the Popen and the first 200 from GET /health, stops the server with SIGTERM, and
prints each event in seconds after the Popen. Nothing in the library changes for this.

Since the ranks are started first thing and forked (treeattn.parallel.spawn.StartedRanks), a rank
has no "interpreter started" or "import torch done" line of its own: it shares the server's; its
first line is "process group ready", once the server has handed it its work.

Each repeat also times one process's `ta.load_model(GGUF)` from the file (TREEATTN_GGUF_CACHE=0,
benchmarks/models/gguf_load.py's child), the yardstick of issue #28's goal: /health within 1.5x of (that
load + 2 s). --before DIR: a second source tree (e.g. `git archive` of an older commit, its src/
directory) whose server is timed too, alternating with this one's, so both see the same machine load.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from treeattn.bench import harness

SITECUSTOMIZE = r'''
import builtins, logging, os, sys, time
_EVENTS = os.environ["TREEATTN_TIMELINE_EVENTS"]
def _event(what):
    with open(_EVENTS, "a") as f:
        f.write(f"{time.time():.4f} {os.getpid()} {what}\n")
_event("interpreter started: " + " ".join(sys.argv)[:60])
_WATCH = {"torch", "fastapi", "uvicorn"}
_real_import = builtins.__import__
def _import(name, *args, **kwargs):
    outermost = name in _WATCH and name not in sys.modules  # torch's own modules import torch while it loads
    module = _real_import(name, *args, **kwargs)
    if outermost:
        _WATCH.discard(name)
        _event(f"import {name} done")
        if not _WATCH:
            builtins.__import__ = _real_import
    return module
builtins.__import__ = _import
_handler = logging.FileHandler(_EVENTS)
_handler.setFormatter(logging.Formatter("%(created).4f %(process)d %(name)s: %(message)s"))
_logger = logging.getLogger("treeattn")
_logger.addHandler(_handler)
_logger.setLevel(logging.DEBUG)
'''


def timeline(model: str, nproc: int, source: str | None = None) -> tuple[float, list[str]]:
    """(seconds to the first 200 on /health, the events as lines `seconds pid what`); `source`: the
    src/ directory to run (default: this process's PYTHONPATH)."""
    work = Path(tempfile.mkdtemp(prefix="treeattn-timeline-"))
    (work / "sitecustomize.py").write_text(SITECUSTOMIZE)
    events = work / "events"
    path = source if source is not None else os.environ.get("PYTHONPATH", "")
    env = dict(os.environ, PYTHONPATH=f"{work}{os.pathsep}{path}", TREEATTN_TIMELINE_EVENTS=str(events), PYTHONUNBUFFERED="1")
    start = time.time()
    process = subprocess.Popen([sys.executable, "-m", "treeattn", "serve", model, "--nproc", str(nproc), "--port", "0",
                                "--log-level", "debug"], stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env)
    url = None
    try:
        for line in process.stderr:
            if "treeattn serve:" in line and " on http://" in line:
                url = line.split(" on ", 1)[1].split()[0]
                break
        if url is None:
            raise RuntimeError(f"the server exited with {process.wait()} before listening")
        while True:
            try:
                with urllib.request.urlopen(url + "/health", timeout=5) as response:
                    if response.status == 200:
                        ready = time.time() - start
                        break
            except OSError:
                time.sleep(0.01)
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=60)
    rows = []
    for line in events.read_text().splitlines():
        stamp, pid, what = line.split(" ", 2)
        rows.append((float(stamp) - start, int(pid), what))
    rows.append((ready, process.pid, "first 200 from /health (seen by the client)"))
    rows.sort()
    pids = {process.pid: "server"}
    for _, pid, what in rows:
        if pid not in pids:
            pids[pid] = f"proc{len(pids)}"
    for f in work.iterdir():
        f.unlink()
    work.rmdir()
    return ready, [f"{t:7.2f}  {pids[pid]:<7} {what}" for t, pid, what in rows]


def load_s(model: str) -> float:
    """One fresh process's ta.load_model(model) from the file (the GGUF cache off), in seconds."""
    import json

    child = ("import json, sys, time; import treeattn as ta; start = time.perf_counter(); ta.load_model(sys.argv[1]); "
             "print(json.dumps({'load_s': time.perf_counter() - start}))")
    out = subprocess.run([sys.executable, "-c", child, model], capture_output=True, text=True, check=True,
                         env=dict(os.environ, TREEATTN_GGUF_CACHE="0"))
    return json.loads(out.stdout.strip().splitlines()[-1])["load_s"]


def main() -> None:
    import statistics

    parser = harness.parser(__doc__, model="smollm2", nproc=2, repeats=1, output=False)
    parser.add_argument("--before", default=None, help="another src/ directory to time too (alternating)")
    args = harness.parse_args(parser)
    trees = {"after": None} if args.before is None else {"before": args.before, "after": None}
    ready: dict[str, list[float]] = {label: [] for label in trees}
    loads = []
    for _ in range(args.repeats):
        load = load_s(args.model)
        loads.append(load)
        print(f"--- one process's load from the file: {load:.2f} s (load average {os.getloadavg()[0]:.1f})", flush=True)
        for label, source in trees.items():
            average = os.getloadavg()[0]
            seconds, lines = timeline(args.model, args.nproc, source)
            ready[label].append(seconds)
            print(f"--- {label}: treeattn serve --nproc {args.nproc}: /health after {seconds:.2f} s (load average {average:.1f} "
                  f"at the start); "
                  f"this repeat: {seconds:.2f} / ({load:.2f} + 2) = {seconds / (load + 2):.2f}x")
            print("\n".join(lines), flush=True)
    load = statistics.median(loads)
    print(f"one process's load from the file: {load:.2f} s (median of {len(loads)}); goal: /health within 1.5 x {load + 2:.2f} s "
          f"= {1.5 * (load + 2):.2f} s")
    for label, runs in ready.items():
        median = statistics.median(runs)
        paired = [r / (one + 2) for r, one in zip(runs, loads)]  # each serve against the load timed just before it
        print(f"{label}: /health after {median:.2f} s (median of {len(runs)}: {', '.join(f'{r:.2f}' for r in runs)}); "
              f"ratio {median / (load + 2):.2f}x (goal <= 1.5x); per repeat {', '.join(f'{x:.2f}x' for x in paired)}, "
              f"median {statistics.median(paired):.2f}x")
    if args.before is not None:
        print(f"after / before: {statistics.median(ready['after']) / statistics.median(ready['before']):.2f}")


if __name__ == "__main__":
    main()
