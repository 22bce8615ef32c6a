"""`treeattn bench serve`: an open-loop load generator for an OpenAI-compatible server (ours, vLLM's,
llama.cpp's), and its report in the shape `vllm bench serve` writes.

    config = ServeBenchConfig(base_url="http://127.0.0.1:8000", num_prompts=64, input_len=512, output_len=64,
                              request_rate=4.0, max_concurrency=8, goodput={"ttft": 500.0})
    result = run_serve_benchmark(config)      # the JSON dict: completed, request_throughput, mean_ttft_ms, ttfts, itls, ...

Requests arrive open-loop: their send times are drawn before the run (Poisson arrivals: gamma
intervals of shape `burstiness` and mean 1 / request_rate, as vLLM draws them; "constant": every
1 / request_rate s; request_rate inf: all at once), whatever the server does, and `max_concurrency`
(None: no limit) caps the requests in flight, so request_rate inf with max_concurrency N is a fixed
concurrency of N. Each request streams (`stream: true`, `stream_options.include_usage`) over the
completions or chat endpoint with httpx; the time to first token is the first chunk with text (or
the finishing chunk, when no text came before it), every later chunk with text adds one inter-token latency (a chunk of several
tokens counts once, as in
vLLM), the output length is the server's `usage.completion_tokens`, and TPOT is (latency - TTFT) /
(output tokens - 1). Prompts are synthetic (`input_len` random token ids from [min_token_id,
max_token_id), a list the completions endpoint takes; `ignore_eos` keeps every answer `output_len`
tokens long) or read from a file (one prompt per line, or JSON lines with "prompt" and optionally
"output_len").

A request is good when each of its metrics named in `goodput` (ttft, tpot, e2el: milliseconds) is at
most the bound: request_goodput is good requests per second (vLLM's --goodput).
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import numpy as np

METRICS = ("ttft", "tpot", "itl", "e2el")
GOODPUT_METRICS = ("ttft", "tpot", "e2el")


@dataclass(frozen=True)
class ServeBenchConfig:
    """One benchmark run (see the module docstring). Validated on construction: one line naming the field.

    Example::

        >>> from treeattn.bench.serving import ServeBenchConfig, parse_goodput
        >>> ServeBenchConfig(base_url="http://127.0.0.1:8000", request_rate=2.0, goodput=parse_goodput("ttft:500 tpot:50")).goodput
        {'ttft': 500.0, 'tpot': 50.0}
        >>> try:
        ...     ServeBenchConfig(base_url="http://127.0.0.1:8000", request_rate=0)
        ... except ValueError as error:
        ...     print(error)
        request_rate must be a number > 0 (inf: every request at once), got 0
    """  # noqa: E501

    base_url: str
    model: str | None = None  # None: the first model /v1/models lists
    endpoint: str = "/v1/completions"
    num_prompts: int = 100
    input_len: int = 512
    output_len: int = 128
    range_ratio: float = 0.0  # synthetic lengths uniform in [len * (1 - r), len * (1 + r)]
    min_token_id: int = 100
    max_token_id: int = 1000
    dataset_path: str | None = None
    request_rate: float = math.inf
    arrival: str = "poisson"  # or "constant"
    burstiness: float = 1.0
    max_concurrency: int | None = None
    goodput: dict = field(default_factory=dict)
    percentiles: tuple[float, ...] = (50.0, 90.0, 99.0)
    seed: int = 0
    api_key: str | None = None
    timeout_s: float = 600.0
    label: str | None = None
    ignore_eos: bool = True  # every answer output_len tokens long (vLLM's default for its random prompts)
    # more fields of every request (e.g. a logit_bias for servers without ignore_eos)
    extra_body: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        checks = (
            ("base_url", isinstance(self.base_url, str) and self.base_url.startswith(("http://", "https://")), "an http(s) URL"),
            ("endpoint", self.endpoint in ("/v1/completions", "/v1/chat/completions"), "/v1/completions or /v1/chat/completions"),
            ("num_prompts", _int_at_least(self.num_prompts, 1), "an int >= 1"),
            ("input_len", _int_at_least(self.input_len, 1), "an int >= 1"),
            ("output_len", _int_at_least(self.output_len, 1), "an int >= 1"),
            ("range_ratio", isinstance(self.range_ratio, (int, float)) and 0 <= self.range_ratio < 1, "a number in [0, 1)"),
            ("min_token_id", _int_at_least(self.min_token_id, 0), "an int >= 0"),
            ("max_token_id", _int_at_least(self.max_token_id, self.min_token_id + 1), "an int > min_token_id"),
            ("request_rate", isinstance(self.request_rate, (int, float)) and self.request_rate > 0,
             "a number > 0 (inf: every request at once)"),
            ("arrival", self.arrival in ("poisson", "constant"), "'poisson' or 'constant'"),
            ("burstiness", isinstance(self.burstiness, (int, float)) and 0 < self.burstiness < math.inf, "a number > 0"),
            ("max_concurrency", self.max_concurrency is None or _int_at_least(self.max_concurrency, 1), "None or an int >= 1"),
            ("goodput", isinstance(self.goodput, dict) and all(k in GOODPUT_METRICS and v > 0 for k, v in self.goodput.items()),
             f"a dict of {GOODPUT_METRICS} to milliseconds > 0"),
            ("percentiles", all(0 < p < 100 for p in self.percentiles), "numbers in (0, 100)"),
            ("timeout_s", isinstance(self.timeout_s, (int, float)) and self.timeout_s > 0, "a number > 0"),
            ("extra_body", isinstance(self.extra_body, dict), "a dict of request fields"),
        )
        for name, ok, expected in checks:
            if not ok:
                raise ValueError(f"{name} must be {expected}, got {getattr(self, name)!r}")


def _int_at_least(value, low: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= low


def parse_goodput(text: str) -> dict[str, float]:
    """vLLM's --goodput: "ttft:500 tpot:50" (milliseconds) -> {"ttft": 500.0, "tpot": 50.0}; ValueError naming the bad pair."""
    out = {}
    for pair in text.replace(",", " ").split():
        name, _, value = pair.partition(":")
        try:
            number = float(value)
        except ValueError:
            number = float("nan")
        if name not in GOODPUT_METRICS or not number > 0:
            raise ValueError(f"goodput: each item must be NAME:MILLISECONDS with NAME in {GOODPUT_METRICS} and a number > 0, "
                             f"got {pair!r}")
        out[name] = number
    return out


@dataclass(frozen=True)
class BenchRequest:
    """One request to send: its prompt (text or token ids), the prompt's length where known, its max_tokens."""

    prompt: str | list[int]
    prompt_len: int | None
    output_len: int


@dataclass
class RequestOutcome:
    """What one request gave (seconds): success, ttft, the inter-token latencies, latency, token counts, error."""

    success: bool = False
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    prompt_len: int = 0
    output_len: int = 0
    start_time: float = 0.0
    generated_text: str = ""
    error: str = ""


def make_requests(config: ServeBenchConfig) -> list[BenchRequest]:
    """The run's requests: synthetic random token ids, or the prompts of config.dataset_path (cycled
    to num_prompts), drawn from a generator seeded by config.seed."""
    rng = random.Random(config.seed)
    if config.dataset_path is not None:
        prompts = _read_prompts(Path(config.dataset_path), config.output_len)
        return [prompts[i % len(prompts)] for i in range(config.num_prompts)]

    def length(mean: int) -> int:
        return max(1, rng.randint(int(mean * (1 - config.range_ratio)), int(mean * (1 + config.range_ratio))))

    out = []
    for _ in range(config.num_prompts):
        n = length(config.input_len)
        out.append(BenchRequest([rng.randrange(config.min_token_id, config.max_token_id) for _ in range(n)], n,
                                length(config.output_len)))
    return out


def _read_prompts(path: Path, output_len: int) -> list[BenchRequest]:
    """One prompt per non-empty line; a .jsonl file: one object per line with "prompt" (text or token ids)
    and optionally "output_len" (and "prompt_len", the text's token count, used when the server sends no usage). ValueError
    naming the file and line."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"dataset_path: cannot read {path}: {exc}") from None
    out = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        if path.suffix != ".jsonl":
            out.append(BenchRequest(line, None, output_len))
            continue
        try:
            item = json.loads(line)
            prompt, n = item["prompt"], int(item.get("output_len", output_len))
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(
                f"dataset_path: {path}:{number}: expected an object with 'prompt' (and 'output_len'): {exc}"
            ) from None
        known = len(prompt) if isinstance(prompt, list) else item.get("prompt_len")
        out.append(BenchRequest(prompt, int(known) if known is not None else None, n))
    if not out:
        raise ValueError(f"dataset_path: {path} holds no prompt")
    return out


def arrival_times(config: ServeBenchConfig, count: int) -> list[float]:
    """Seconds after the start at which each request is sent (open loop: drawn before the run)."""
    if math.isinf(config.request_rate):
        return [0.0] * count
    if config.arrival == "constant":
        return [i / config.request_rate for i in range(count)]
    rng = np.random.default_rng(config.seed)
    theta = 1.0 / (config.request_rate * config.burstiness)  # gamma(shape=burstiness, scale=theta): mean 1 / rate
    gaps = rng.gamma(shape=config.burstiness, scale=theta, size=count)
    gaps[0] = 0.0
    return np.cumsum(gaps).tolist()


async def _send(client, config: ServeBenchConfig, model: str, request: BenchRequest) -> RequestOutcome:
    """Stream one request; measure it (see the module docstring)."""
    chat = config.endpoint == "/v1/chat/completions"
    body = {"model": model, "max_tokens": request.output_len, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}}
    if config.ignore_eos:
        body["ignore_eos"] = True
    body.update(config.extra_body)
    if chat:
        body["messages"] = [{"role": "user", "content": request.prompt}]
    else:
        body["prompt"] = request.prompt
    out = RequestOutcome(prompt_len=request.prompt_len or 0, start_time=time.perf_counter())
    last, texts = None, []
    try:
        async with client.stream("POST", config.endpoint, json=body) as response:
            if response.status_code != 200:
                out.error = f"HTTP {response.status_code}: {(await response.aread()).decode(errors='replace')[:300]}"
                return out
            async for line in response.aiter_lines():
                if not line.startswith("data:") or line.strip() == "data: [DONE]":
                    continue
                chunk, now = json.loads(line[5:]), time.perf_counter()
                if "error" in chunk:
                    out.error = str(chunk["error"].get("message", chunk["error"]))[:300]
                    return out
                if chunk.get("usage"):
                    out.output_len = chunk["usage"]["completion_tokens"]
                    out.prompt_len = chunk["usage"]["prompt_tokens"]
                choices = chunk.get("choices") or ()
                text = "".join((c.get("delta") or {}).get("content") or "" if chat else c.get("text") or "" for c in choices)
                # a token shows as text; tokens that end inside a character come with a later chunk, the last with the finish
                if text or (last is None and any(c.get("finish_reason") for c in choices)):
                    if last is None:
                        out.ttft = now - out.start_time
                    else:
                        out.itl.append(now - last)
                    last = now
                    texts.append(text)
        out.latency = time.perf_counter() - out.start_time
        if not out.output_len:  # a server that sends no usage (llama-cpp-python's): one chunk with text per token
            out.output_len = sum(1 for t in texts if t)
        out.generated_text = "".join(texts)
        out.success = last is not None
        out.error = "" if out.success else "no token came back"
    except Exception as exc:  # noqa: BLE001 -- one failed request is one record, not the end of the run
        out.error = f"{type(exc).__name__}: {exc}"[:300]
    return out


async def _run(config: ServeBenchConfig, requests: list[BenchRequest]) -> tuple[list[RequestOutcome], float, str]:
    import httpx

    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    limits = httpx.Limits(max_connections=config.max_concurrency or len(requests), max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=config.base_url, headers=headers, timeout=config.timeout_s, limits=limits) as client:
        model = config.model or await _first_model(client)
        gate = asyncio.Semaphore(config.max_concurrency or len(requests))
        times = arrival_times(config, len(requests))
        start = time.perf_counter()

        async def one(request: BenchRequest, at: float) -> RequestOutcome:
            await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
            async with gate:
                return await _send(client, config, model, request)

        outcomes = await asyncio.gather(*(one(r, t) for r, t in zip(requests, times)))
        return list(outcomes), time.perf_counter() - start, model


async def _first_model(client) -> str:
    """The first model id of the server's /v1/models; ValueError naming base_url when it does not answer one."""
    import httpx

    try:
        response = await client.get("/v1/models")
        response.raise_for_status()
        return response.json()["data"][0]["id"]
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as exc:
        raise ValueError(f"base_url: {str(client.base_url).rstrip('/')}/v1/models gave no model id ({type(exc).__name__}: "
                         f"{exc}); "
                         "is the server up? (or pass --model)") from None


def run_serve_benchmark(config: ServeBenchConfig) -> dict:
    """Run the benchmark against config.base_url; the result dict (summarize's)."""
    requests = make_requests(config)
    outcomes, duration, model = asyncio.run(_run(config, requests))
    return summarize(config, outcomes, duration, model)


def summarize(config: ServeBenchConfig, outcomes: list[RequestOutcome], duration: float, model: str) -> dict:
    """`vllm bench serve`'s result JSON: run metadata, totals and throughputs, per-request lists (seconds:
    ttfts, itls, latencies), and mean/median/std/p{P} of ttft, tpot, itl and e2el in milliseconds."""
    done = [o for o in outcomes if o.success]
    values = {"ttft": [o.ttft for o in done], "e2el": [o.latency for o in done], "itl": [x for o in done for x in o.itl],
              "tpot": [(o.latency - o.ttft) / (o.output_len - 1) for o in done if o.output_len > 1]}
    good = sum(1 for o in done if _is_good(o, config.goodput))
    total_in, total_out = sum(o.prompt_len for o in done), sum(o.output_len for o in done)
    result = {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
              "endpoint_type": "openai-chat" if "chat" in config.endpoint else "openai",
        "backend": "openai-chat" if "chat" in config.endpoint else "openai", "label": config.label, "model_id": model,
        "tokenizer_id": model, "num_prompts": config.num_prompts,
        "request_rate": config.request_rate if math.isfinite(config.request_rate) else "inf", "burstiness": config.burstiness,
        "arrival": config.arrival, "max_concurrency": config.max_concurrency, "duration": duration, "completed": len(done),
        "failed": len(outcomes) - len(done), "total_input_tokens": total_in, "total_output_tokens": total_out,
        "request_throughput": len(done) / duration, "request_goodput": good / duration if config.goodput else None,
        "goodput_slos_ms": dict(config.goodput) or None,
        "output_throughput": total_out / duration, "total_token_throughput": (total_in + total_out) / duration,
        "input_lens": [o.prompt_len for o in outcomes], "output_lens": [o.output_len for o in outcomes],
        "ttfts": [o.ttft for o in outcomes], "itls": [o.itl for o in outcomes], "start_times": [o.start_time for o in outcomes],
        "generated_texts": [o.generated_text for o in outcomes], "errors": [o.error for o in outcomes],
    }
    for name in METRICS:
        ms = np.asarray(values[name], dtype=np.float64) * 1000.0
        result[f"mean_{name}_ms"] = float(ms.mean()) if ms.size else 0.0
        result[f"median_{name}_ms"] = float(np.median(ms)) if ms.size else 0.0
        result[f"std_{name}_ms"] = float(ms.std()) if ms.size else 0.0
        for p in config.percentiles:
            result[f"p{p:g}_{name}_ms"] = float(np.percentile(ms, p)) if ms.size else 0.0
    return result


def _is_good(outcome: RequestOutcome, slos: dict[str, float]) -> bool:
    measured = {"ttft": outcome.ttft, "e2el": outcome.latency,
                "tpot": (outcome.latency - outcome.ttft) / (outcome.output_len - 1) if outcome.output_len > 1 else 0.0}
    return all(measured[name] * 1000.0 <= bound for name, bound in slos.items())


def report_lines(result: dict, percentiles: tuple[float, ...]) -> list[str]:
    """The summary `vllm bench serve` prints, as lines."""
    rows = [("Successful requests:", result["completed"]), ("Failed requests:", result["failed"]),
            ("Benchmark duration (s):", f"{result['duration']:.2f}"), ("Total input tokens:", result["total_input_tokens"]),
            ("Total generated tokens:", result["total_output_tokens"]),
            ("Request throughput (req/s):", f"{result['request_throughput']:.2f}")]
    if result["request_goodput"] is not None:
        rows.append(("Request goodput (req/s):", f"{result['request_goodput']:.2f}"))
    rows += [("Output token throughput (tok/s):", f"{result['output_throughput']:.2f}"),
             ("Total token throughput (tok/s):", f"{result['total_token_throughput']:.2f}")]
    lines = ["{:=^50}".format(" Serving Benchmark Result ")] + [f"{k:<40} {v:<10}" for k, v in rows]
    for name, title in (("ttft", "Time to First Token"), ("tpot", "Time per Output Token (excl. 1st token)"),
                        ("itl", "Inter-token Latency"), ("e2el", "End-to-end Latency")):
        lines.append("{:-^50}".format(title))
        label = name.upper()
        lines += [f"{'Mean ' + label + ' (ms):':<40} {result[f'mean_{name}_ms']:<10.2f}",
                  f"{'Median ' + label + ' (ms):':<40} {result[f'median_{name}_ms']:<10.2f}"]
        lines += [f"{f'P{p:g} {label} (ms):':<40} {result[f'p{p:g}_{name}_ms']:<10.2f}" for p in percentiles]
    return lines + ["=" * 50]
