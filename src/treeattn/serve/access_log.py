"""One log line per HTTP request, after its response has been sent (uvicorn's and llama-server's
access log, with the engine's numbers):

    127.0.0.1:53122 "POST /v1/chat/completions" 200 prompt_tokens=37 completion_tokens=16 ttft=0.412s duration=1.873s

    app.add_middleware(AccessLog)      # outermost: it sees every answer, 401/413/429 and 500 too
    usage = request.scope.get(USAGE)   # a handler fills in the tokens and the first token's time

Logged by the logger "treeattn.serve.access" at INFO (`treeattn serve --log-level warning` hides
it). The route is the path without its query string; a streamed response is logged when its last
chunk has gone (or the client went away), so the duration covers the whole answer. Token counts and
the time to first token appear for the requests that ran on the engine.
"""

from __future__ import annotations

import logging
import time

logger = logging.getLogger("treeattn.serve.access")

USAGE = "treeattn.usage"
"""The ASGI scope key of a request's usage dict: prompt_tokens, completion_tokens, first_token_at
(time.perf_counter() of its first generated token), filled in by the endpoint that runs it."""


class Usage(dict):
    """A request's numbers for its access line (a dict, so the handler can fill it in place)."""

    def token(self, now: float) -> None:
        """One generated token at `now` (time.perf_counter())."""
        self.setdefault("first_token_at", now)
        self["completion_tokens"] = self.get("completion_tokens", 0) + 1


class AccessLog:
    """ASGI middleware writing one access line per HTTP request (see the module docstring)."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start = time.perf_counter()
        usage = scope[USAGE] = Usage()
        status = None

        async def send_and_watch(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_watch)
        except BaseException:
            status = status or 500
            raise
        finally:
            if logger.isEnabledFor(logging.INFO):
                logger.info("%s", access_line(scope, status, usage, time.perf_counter() - start, start))


def access_line(scope, status: int | None, usage: dict, duration_s: float, start: float) -> str:
    """The access line of one request (see the module docstring); status None: no answer was sent
    (the client went away first)."""
    client = scope.get("client")
    peer = f"{client[0]}:{client[1]}" if client else "-"
    line = f'{peer} "{scope.get("method", "-")} {_printable(scope.get("path", "-"))}" {status if status is not None else "-"}'
    if "prompt_tokens" in usage:
        line += f" prompt_tokens={usage['prompt_tokens']} completion_tokens={usage.get('completion_tokens', 0)}"
        first = usage.get("first_token_at")
        line += f" ttft={first - start:.3f}s" if first is not None else " ttft=-"
    return line + f" duration={duration_s:.3f}s"


def _printable(path: str, limit: int = 200) -> str:
    """The client's path as one safe log token: at most `limit` characters, quotes and control
    characters escaped (a path must not forge a log line)."""
    text = "".join(c if c.isprintable() and c not in '"\\' else f"\\x{ord(c):02x}" for c in path[:limit])
    return text + ("..." if len(path) > limit else "")


__all__ = ["AccessLog", "USAGE", "Usage", "access_line"]
