"""`treeattn serve`: the OpenAI-compatible server on the command line (parses, validates, prints)."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Literal

import typer

from treeattn.engine.config import EngineConfig as E
from treeattn.commands.flags import config_options, dtype_flag, model_argument, torch_dtype

LogLevel = Literal["debug", "info", "warning", "error", "critical"]


SERVE_ENGINE_FLAGS = ("nproc", "tp", "decode", "method", "placement", "max_batch_size", "cache_tokens", "max_context",
                      "prefix_cache", "block_size", "prefill", "kv_cache_dtype", "weight_format", "activation_format",
                      "prefill_dtype", "device",
                      "speculate",
                      "draft_tokens", "draft_model", "linear_maps", "kv_store", "kv_store_bytes", "shared_memory",
                      "decode_step", "timeout_s")


@config_options(E, SERVE_ENGINE_FLAGS, into="engine",
                nproc={"help": "Ranks sharing the KV cache (ignored under torchrun: its world size)."},
                block_size={"min": 1}, timeout_s={"max": None})
def serve_command(
    model: Path = model_argument(),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to bind; 0.0.0.0 to listen on every interface."),
    port: int = typer.Option(8000, "--port", min=0, max=65535, help="Port (0: any free port, printed at start)."),
    dtype: str = dtype_flag(),
    api_key: str | None = typer.Option(None, "--api-key", envvar="TREEATTN_API_KEY", show_envvar=True,
                                       help="Require 'Authorization: Bearer KEY' on every endpoint but /health. On the "
                                       "command line it shows in `ps`: prefer the environment variable or --api-key-file."),
    api_key_file: Path | None = typer.Option(None, "--api-key-file", help="Read the API key from this file (its first line)."),
    served_model_name: list[str] | None = typer.Option(None, "--served-model-name", metavar="NAME",
                                                       help="The model id clients name (default: the "
                                                       "file or directory name); repeat it for aliases: the first is the name "
                                                       "/v1/models "
                                                       "lists first and answers carry, every one is accepted (vLLM's)."),
    max_pending: int = typer.Option(256, "--max-pending", min=1, help="Requests (choices) in flight at most; more get 429 "
                                    "(a request asking alone for more: 400)."),
    max_request_bytes: int = typer.Option(4 << 20, "--max-request-bytes", min=1, help="Largest request body taken, in bytes; "
                                          "larger ones get 413."),
    body_timeout: float = typer.Option(10.0, "--body-timeout", min=0.001, help="Seconds a client may take to send a "
                                       "request's body after its headers; then 408."),
    drain: float = typer.Option(30.0, "--drain", min=0.0, help="Seconds to let running requests finish after SIGTERM."),
    log_level: LogLevel = typer.Option("info", "--log-level", help="Messages on stderr from this level up: info shows the "
                                       "start-up steps and one access line per request; warning only problems."),
    engine: dict | None = None,
) -> None:
    """Serve MODEL over an OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, /v1/models, /health, /metrics)."""
    import logging

    from treeattn.serve.server import ServeOptions, serve

    logging.getLogger("treeattn").setLevel(log_level.upper())  # the root logger's handler (treeattn.cli) writes to stderr

    if not model.exists():
        _fail(f"MODEL: no such file or directory: {model}")
    api_key = _api_key(api_key, api_key_file)
    try:
        names = list(served_model_name or [])
        options = ServeOptions(host=host, port=port, model_name=names[0] if names else None, aliases=tuple(names[1:]),
                               api_key=api_key, max_pending=max_pending,
                               drain_s=drain, max_request_bytes=max_request_bytes, body_timeout_s=body_timeout,
                               log_level="warning" if log_level == "info" else log_level)
    except ValueError as exc:
        _fail(str(exc))
    engine_options = {**engine, "dtype": torch_dtype(dtype)}

    def ready(bound_host: str, bound_port: int) -> None:
        from treeattn.parallel.spawn import under_torchrun
        from treeattn.serve.child import ready_line

        ranks = int(os.environ["WORLD_SIZE"]) if under_torchrun() else engine["nproc"]
        typer.echo(ready_line(model, bound_host, bound_port, ranks, engine["decode"]), err=True)

    try:
        status = serve(str(model), options, engine_options, on_ready=ready)
        typer.echo(f"treeattn serve: stopped ({'cleanly' if status == 0 else 'after a failure'}), the engine closed", err=True)
    except (ValueError, TypeError) as exc:
        from treeattn.engine.config import ConfigError
        from treeattn.commands.flags import cli_message

        _fail(cli_message(exc) if isinstance(exc, ConfigError) else str(exc))
    raise typer.Exit(status)


def _api_key(given: str | None, path: Path | None) -> str | None:
    """The key from --api-key / TREEATTN_API_KEY, or --api-key-file's first line (not both). A key on the
    command line is visible to every user in `ps` (and in the ranks', which are forked from this process):
    a warning says so."""
    import logging

    if path is not None:
        if given is not None:
            _fail("--api-key-file: give the key once (--api-key or TREEATTN_API_KEY is set too)")
        try:
            lines = path.read_text().splitlines()
        except (OSError, UnicodeDecodeError) as exc:
            _fail(f"--api-key-file: cannot read {path}: {exc}")
        if not lines or not lines[0].strip():
            _fail(f"--api-key-file: {path} holds no key on its first line")
        return lines[0].strip()
    if given is not None and any(arg == "--api-key" or arg.startswith("--api-key=") for arg in sys.argv):
        logging.getLogger("treeattn.serve.server").warning(
            "--api-key on the command line is visible to every user in `ps`; use TREEATTN_API_KEY or --api-key-file")
    return given


def _fail(message: str) -> None:
    typer.echo(f"treeattn serve: error: {message}", err=True)
    raise typer.Exit(2)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(typer.run(serve_command))
