"""`treeattn serve` in a child process for the server tests, a tiny GGUF model for it, and its /metrics.

    server = Server(_write_tiny_llama_gguf(path, seed=0, hidden_size=64, ...))
    server.client().completions.create(model=NAME, prompt="hi")     # the official openai client
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import gguf
import httpx
import pytest
import torch

transformers = pytest.importorskip("transformers")
openai = pytest.importorskip("openai")

from gguf_files import CHATML, VOCAB, write_gguf  # noqa: E402

from treeattn.serve.child import start_serve  # noqa: E402

KEY = "test-key"
NAME = "tiny"
ENGINE_ARGS = ["--block-size", "16", "--cache-tokens", "4096", "--max-batch-size", "8"]


def _write_tiny_llama_gguf(path: Path, seed: int, chat_template: str = CHATML, context_length: int = 512, **sizes) -> Path:
    """A random transformers Llama of `sizes` with the byte-level tokenizer and `chat_template`, as an F16 GGUF file."""
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(**sizes, vocab_size=VOCAB, bos_token_id=1, eos_token_id=2, initializer_range=0.1,
                                      rms_norm_eps=1e-5, tie_word_embeddings=False,
                                      rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    write_gguf(path, transformers.LlamaForCausalLM(config).eval(), gguf.GGMLQuantizationType.F16, context_length=context_length,
               chat_template=chat_template)
    return path


class Server:
    """`treeattn serve` in a child process on a free port."""

    def __init__(self, model: Path, *extra: str) -> None:
        child = start_serve(model, *ENGINE_ARGS, *extra, env=dict(os.environ, OMP_NUM_THREADS="1"))
        self.process, self.url, self.lines = child.process, child.url, child.lines  # lines: stderr, kept read
        self.children = _children(self.process.pid)

    def client(self, key: str | None = KEY) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=key or "none", max_retries=0, timeout=120)

    def http(self, key: str | None = KEY) -> httpx.Client:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=120)

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout=60)
        finally:
            if self.process.poll() is None:
                self.process.kill()


def _children(pid: int) -> list[int]:
    """Every live descendant of pid (from /proc)."""
    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    found, frontier = [], [pid]
    while frontier:
        parent = frontier.pop()
        kids = [p for p, pp in parents.items() if pp == parent]
        found += kids
        frontier += kids
    return found


def _alive(pids: list[int]) -> list[int]:
    alive = []
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            alive.append(pid)
    return alive


def _metrics(server: Server) -> dict[str, float]:
    text = server.http().get("/metrics").text
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    return values


def _wait_idle(server: Server, timeout: float = 20.0) -> dict[str, float]:
    """Wait until nothing runs or waits and every used block belongs to the prefix cache."""
    deadline = time.monotonic() + timeout
    while True:
        m = _metrics(server)
        idle = (m["treeattn_requests_running"] == 0 and m["treeattn_requests_waiting"] == 0
                and m['treeattn_kv_blocks{state="used"}'] == m['treeattn_kv_blocks{state="cached"}'])
        if idle or time.monotonic() > deadline:
            return m
        time.sleep(0.2)


def stream_in_background(server: Server, max_tokens: int = 150) -> tuple[threading.Thread, list[str], threading.Event]:
    """Start one streamed greedy completion of "the cat" (with usage) in a thread: (the thread, the SSE
    lines as they arrive, an event set at the first line). For the drain tests (SIGTERM, Ctrl-C)."""
    lines: list[str] = []
    started = threading.Event()

    def stream():
        body = {"model": NAME, "prompt": "the cat", "max_tokens": max_tokens, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}}
        with server.http().stream("POST", "/v1/completions", json=body) as response:
            for line in response.iter_lines():
                if line:
                    lines.append(line)
                    started.set()

    reader = threading.Thread(target=stream)
    reader.start()
    return reader, lines, started
