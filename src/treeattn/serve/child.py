"""`treeattn serve` in a child process: its ready line, and starting it to get its URL.

    child = start_serve("model.gguf", "--nproc", "2")     # --port 0: a free port; waits for the ready line
    httpx.get(child.url + "/health")                        # child.url: "http://127.0.0.1:PORT"
    child.process.send_signal(signal.SIGTERM); child.process.wait()

The command prints one line on stderr once it listens (`ready_line`); `ready_url` reads the URL back
from it. The tests' server fixture, the README's client test and the benchmarks that time a server
(benchmarks/serving/serve_load.py, gguf_load.py) start it this way. Nothing here imports FastAPI.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path

_READY = re.compile(r" on (http://[^\s]+:\d+) \((\d+) rank\(s\)")


def ready_line(model, host: str, port: int, ranks: int, decode: str) -> str:
    """The line `treeattn serve` writes to stderr once it listens (the model's file or directory name, not its path)."""
    return f"treeattn serve: {Path(model).name} on http://{host}:{port} ({ranks} rank(s), decode {decode})"


def ready_url(line: str) -> tuple[str, int] | None:
    """(URL, ranks) from a ready_line, or None for any other line."""
    match = _READY.search(line)
    return (match.group(1), int(match.group(2))) if match else None


@dataclass
class ServeChild:
    """A running `treeattn serve` child: its process, URL, and every stderr line so far (a thread
    keeps reading them, so the pipe never fills)."""

    process: subprocess.Popen
    url: str
    lines: list[str] = field(default_factory=list)


def start_serve(model, *args: str, env: dict | None = None) -> ServeChild:
    """Start `python -m treeattn serve MODEL --port 0 *args` and return once it listens.

    Args:
        model: the model path.
        *args: more flags (a later --port overrides the free port).
        env: the child's environment (default: this one's), PYTHONUNBUFFERED=1 added.

    Raises:
        RuntimeError: the child ended before its ready line (with its exit status and stderr).
    """
    process = subprocess.Popen([sys.executable, "-m", "treeattn", "serve", str(model), "--port", "0", *args],
                               stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                               env=dict(env if env is not None else os.environ, PYTHONUNBUFFERED="1"))
    lines: list[str] = []
    for line in process.stderr:
        lines.append(line)
        ready = ready_url(line)
        if ready is not None:
            child = ServeChild(process, ready[0], lines)
            threading.Thread(target=lambda: lines.extend(process.stderr), daemon=True).start()
            return child
    raise RuntimeError(f"treeattn serve exited with status {process.wait()} before listening: {''.join(lines)[-3000:]}")


__all__ = ["ServeChild", "ready_line", "ready_url", "start_serve"]
