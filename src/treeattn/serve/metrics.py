"""Prometheus metrics of the server (GET /metrics), on a registry of its own.

Counted by the server as requests pass:
    treeattn_requests_total{endpoint, status}        requests answered, by route template ("unmatched":
                                                    no route) and HTTP status (499: the client went away)
    treeattn_requests_cancelled_total{endpoint}      requests whose client went away before the end
                                                    (streamed or not): their choices were cancelled
    treeattn_time_to_first_token_seconds            histogram, from submission to the first token
    treeattn_time_per_output_token_seconds          histogram, per request: decode time / (tokens - 1)
    treeattn_prompt_tokens_total, treeattn_generation_tokens_total  (a prompt counts once, whatever n)
Read from the engine at every scrape (engine.stats()):
    treeattn_requests_running, treeattn_requests_waiting (the queue length)
    treeattn_kv_blocks{state="used"|"free"|"cached"}, treeattn_prefix_cache_hit_tokens_total
    treeattn_generation_tokens_per_second           generated tokens over the last 10 s
    treeattn_spec_decode_draft_tokens_total, treeattn_spec_decode_accepted_tokens_total
                                                    speculative decoding: draft tokens verified, accepted
    treeattn_decode_tokens_per_forward              tokens a decoding sequence gets per forward pass (1 without speculation)
    treeattn_healthy                                1 while the engine and its ranks are alive

Beside them, under vLLM's names (labelled model_name, as vLLM's), so that a dashboard made for vLLM
reads this server:
    vllm:e2e_request_latency_seconds        histogram, submission to the last token
    vllm:request_queue_time_seconds         histogram, submission to the first step that ran it
    vllm:time_to_first_token_seconds        histogram
    vllm:inter_token_latency_seconds        histogram, every gap between a request's tokens as the server got them
    vllm:time_per_output_token_seconds      the same gaps under vLLM's older name
    vllm:prompt_tokens_total, vllm:generation_tokens_total, vllm:request_success_total{finished_reason}
    vllm:num_requests_running, vllm:num_requests_waiting (gauges)
    vllm:kv_cache_usage_perc                blocks held by running requests / all blocks, in [0, 1] (blocks
                                            only the prefix cache holds count as free, as vLLM counts them)
"""

from __future__ import annotations

import collections
import math
import threading
import time

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_RATE_WINDOW_S = 10.0
# vLLM's buckets (vllm/v1/metrics/loggers.py)
_VLLM_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                      80.0, 160.0, 640.0, 2560.0)
_VLLM_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_VLLM_REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
                         960.0, 1920.0, 7680.0)
_VLLM_REASONS = {"stop": "stop", "length": "length", "cancelled": "abort", "error": "error"}


class ServerMetrics:
    """The server's metrics; `engine` is read at scrape time."""

    def __init__(self, engine, model_name: str = "treeattn-model") -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        self.requests = Counter("treeattn_requests", "Requests answered, by endpoint and HTTP status",
                                ["endpoint", "status"], registry=self.registry)
        self.cancelled = Counter("treeattn_requests_cancelled", "Requests cancelled because their client went away",
                                 ["endpoint"], registry=self.registry)
        self.ttft = Histogram("treeattn_time_to_first_token_seconds", "Seconds from submission to the first token",
                              buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.tpot = Histogram("treeattn_time_per_output_token_seconds", "Seconds per generated token after the first",
                              buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.prompt_tokens = Counter("treeattn_prompt_tokens", "Prompt tokens of finished requests", registry=self.registry)
        self.generation_tokens = Counter("treeattn_generation_tokens", "Generated tokens", registry=self.registry)
        self._vllm_metrics()
        self._recent: collections.deque[tuple[float, int]] = collections.deque()
        self._lock = threading.Lock()
        self.registry.register(_EngineCollector(engine, self))

    def _vllm_metrics(self) -> None:
        def histogram(name, documentation, buckets):
            return Histogram(name, documentation, ["model_name"], buckets=buckets, registry=self.registry).labels(self.model_name)

        self.vllm_e2e = histogram("vllm:e2e_request_latency_seconds", "Seconds from submission to the last token",
                                  _VLLM_REQUEST_BUCKETS)
        self.vllm_queue = histogram("vllm:request_queue_time_seconds", "Seconds from submission to the first step that ran it",
                                    _VLLM_REQUEST_BUCKETS)
        self.vllm_ttft = histogram("vllm:time_to_first_token_seconds", "Seconds from submission to the first token",
                                   _VLLM_TTFT_BUCKETS)
        self.vllm_itl = histogram("vllm:inter_token_latency_seconds", "Seconds between a request's tokens", _VLLM_ITL_BUCKETS)
        self.vllm_tpot = histogram("vllm:time_per_output_token_seconds", "Seconds between a request's tokens (vLLM's older name)",
                                   _VLLM_ITL_BUCKETS)
        self.vllm_prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens of finished requests", ["model_name"],
                                          registry=self.registry).labels(self.model_name)
        self.vllm_generation_tokens = Counter("vllm:generation_tokens", "Generated tokens", ["model_name"],
                                              registry=self.registry).labels(self.model_name)
        self.vllm_success = Counter("vllm:request_success", "Finished requests, by finish reason", ["model_name",
                                                                                                    "finished_reason"],
                                    registry=self.registry)

    def inter_token(self, seconds: float) -> None:
        """One gap between two tokens of a request (the server saw them `seconds` apart)."""
        self.vllm_itl.observe(seconds)
        self.vllm_tpot.observe(seconds)

    def record_result(self, result, *, count_prompt: bool = True) -> None:
        """Account one finished choice (a treeattn RequestResult); count_prompt=False for the other
        choices of a prompt (n > 1), whose prompt tokens its first choice counted."""
        tokens = len(result.token_ids)
        if count_prompt:
            self.prompt_tokens.inc(result.prompt_tokens)
        self.generation_tokens.inc(tokens)
        if tokens:
            self.ttft.observe(result.ttft_s)
        if tokens > 1:
            self.tpot.observe(result.decode_s / (tokens - 1))
        if count_prompt:
            self.vllm_prompt_tokens.inc(result.prompt_tokens)
        self.vllm_generation_tokens.inc(tokens)
        if tokens:
            self.vllm_ttft.observe(result.ttft_s)
            self.vllm_e2e.observe(result.ttft_s + result.decode_s)
        if not math.isnan(result.queue_s):
            self.vllm_queue.observe(result.queue_s)
        self.vllm_success.labels(self.model_name, _VLLM_REASONS.get(result.finish_reason, "error")).inc()
        with self._lock:
            self._recent.append((time.monotonic(), tokens))

    def tokens_per_second(self) -> float:
        now = time.monotonic()
        with self._lock:
            while self._recent and now - self._recent[0][0] > _RATE_WINDOW_S:
                self._recent.popleft()
            return sum(n for _, n in self._recent) / _RATE_WINDOW_S

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _EngineCollector:
    """Gauges read off engine.stats() when /metrics is scraped."""

    def __init__(self, engine, metrics: ServerMetrics) -> None:
        self.engine = engine
        self.metrics = metrics

    def collect(self):
        stats = self.engine.stats()
        yield _gauge("treeattn_requests_running", "Requests decoding or prefilling now", stats.get("running", 0))
        yield _gauge("treeattn_requests_waiting", "Requests queued for admission", stats.get("waiting", 0))
        blocks = GaugeMetricFamily("treeattn_kv_blocks", "KV cache blocks (each rank holds its part of every block)",
                                   labels=["state"])
        for state in ("used", "free", "cached"):
            blocks.add_metric([state], stats.get(f"blocks_{state}", 0))
        yield blocks
        hits = CounterMetricFamily("treeattn_prefix_cache_hit_tokens", "Prompt tokens served from the prefix cache")
        hits.add_metric([], stats.get("prefix_hit_tokens", 0))
        yield hits
        if "store_hit_blocks" in stats:  # --kv-store
            yield from _store_metrics(stats)
        for name, key, documentation in (("draft", "drafted_tokens", "Draft tokens verified (speculative decoding)"),
                                         ("accepted", "accepted_tokens", "Draft tokens accepted (speculative decoding)")):
            family = CounterMetricFamily(f"treeattn_spec_decode_{name}_tokens", documentation)
            family.add_metric([], stats.get(key, 0))
            yield family
        yield _gauge("treeattn_decode_tokens_per_forward", "Tokens committed per decoding sequence per forward pass (1 without "
                     "speculation; NaN before the first decode step)", stats.get("tokens_per_forward", float("nan")))
        yield _gauge("treeattn_generation_tokens_per_second", "Generated tokens per second over the last 10 s",
                     self.metrics.tokens_per_second())
        yield _gauge("treeattn_healthy", "1 while the engine and its ranks are alive", 1.0 if stats.get("healthy") else 0.0)
        name = self.metrics.model_name
        yield _gauge("vllm:num_requests_running", "Requests decoding or prefilling now", stats.get("running", 0), name)
        yield _gauge("vllm:num_requests_waiting", "Requests queued for admission", stats.get("waiting", 0), name)
        total = stats.get("blocks_total", 0)
        yield _gauge("vllm:kv_cache_usage_perc", "KV cache usage in [0, 1]: blocks held by running requests over all blocks",
                     stats.get("blocks_active", 0) / total if total else 0.0, name)


def _store_metrics(stats: dict):
    """The KV tiers' counters (treeattn.engine.kv_tier): blocks per tier and result, bytes, seconds."""
    blocks = CounterMetricFamily("treeattn_kv_tier_blocks", "Prompt blocks looked up per tier (arena, then the disk "
                                 "store) by result (failed: a stored block that did not load)", labels=["tier", "result"])
    for tier, key in (("arena", "arena"), ("disk", "store")):
        for result in ("hit", "miss"):
            blocks.add_metric([tier, result], stats.get(f"{key}_{result}_blocks", 0))
    blocks.add_metric(["disk", "failed"], stats.get("store_failed_blocks", 0))
    yield blocks
    moved = CounterMetricFamily("treeattn_kv_store_bytes", "Bytes of KV blocks written to and read from the disk store",
                                labels=["direction"])
    moved.add_metric(["written"], stats.get("store_saved_bytes", 0))
    moved.add_metric(["read"], stats.get("store_loaded_bytes", 0))
    yield moved
    seconds = CounterMetricFamily("treeattn_kv_store_seconds", "Seconds the engine waited on the disk store", labels=["op"])
    seconds.add_metric(["save"], stats.get("store_save_s", 0.0))
    seconds.add_metric(["load"], stats.get("store_load_s", 0.0))
    yield seconds


def _gauge(name: str, documentation: str, value: float, model_name: str | None = None) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, documentation, labels=["model_name"] if model_name is not None else None)
    family.add_metric([model_name] if model_name is not None else [], value)
    return family
