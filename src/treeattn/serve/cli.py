"""`treeattn serve`: the OpenAI-compatible server on the command line (parses, validates, prints)."""

from __future__ import annotations

import os
import sys
from enum import Enum
from pathlib import Path

import typer

from treeattn.engine_cli import Decode, DType, Method, Placement  # the same choices as `treeattn generate`


class Prefill(str, Enum):
    """How the engine runs a step of prompt chunks on several ranks (treeattn.engine.ring_prefill.PREFILL_KINDS)."""

    auto = "auto"
    ring = "ring"
    split = "split"


class Speculate(str, Enum):
    """The engine's speculative decoding (treeattn.engine.engine.ENGINE_SPECULATE_KINDS)."""

    none = "none"
    ngram = "ngram"
    draft = "draft"


class DecodeStep(str, Enum):
    """How the engine runs its decode steps (treeattn.engine.static_step.DECODE_STEPS)."""

    dynamic = "dynamic"
    static = "static"
    graph = "graph"


def serve_command(
    model: Path = typer.Argument(..., help="Hugging Face checkpoint directory or .gguf file."),
    nproc: int = typer.Option(1, "--nproc", min=1, help="Ranks sharing the KV cache (ignored under torchrun: its world size)."),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to bind; 0.0.0.0 to listen on every interface."),
    port: int = typer.Option(8000, "--port", min=0, max=65535, help="Port (0: any free port, printed at start)."),
    decode: Decode = typer.Option(Decode.tree, "--decode", help="Decode attention across ranks."),
    method: Method | None = typer.Option(None, "--method", help="tree_decode combine (default: onepass, one collective per layer)."),
    placement: Placement = typer.Option(Placement.contiguous, "--placement"),
    max_batch_size: int = typer.Option(16, "--max-batch-size", min=1, help="Sequences decoded together at most."),
    cache_tokens: int | None = typer.Option(None, "--cache-tokens", min=1, help="KV cache size in tokens over all ranks."),
    max_context: int | None = typer.Option(None, "--max-context", min=1, help="Most positions (prompt + new tokens) one "
                                           "request may take (default: the whole cache, at most the model's window); "
                                           "--placement contiguous gives each rank a 1/nproc span of it."),
    prefix_cache: bool = typer.Option(True, "--prefix-cache/--no-prefix-cache", help="Reuse cached prompt prefixes."),
    block_size: int = typer.Option(256, "--block-size", min=1, help="Tokens per KV cache block."),
    prefill: Prefill = typer.Option(Prefill.auto, "--prefill", help="Prompt-only steps on several ranks: ring (each rank runs "
                                    "an even zigzag share of the tokens), split (each rank a slice, attention combined), auto "
                                    "(ring, split for sliding-window models)."),
    dtype: DType = typer.Option(DType.float32, "--dtype"),
    speculate: Speculate = typer.Option(Speculate.none, "--speculate", help="Speculative decoding: ngram drafts up to "
                                        "--draft-tokens tokens per sequence per step by prompt lookup, draft with --draft-model; "
                                        "verified in the same forward pass."),
    draft_tokens: int = typer.Option(4, "--draft-tokens", help="Most tokens drafted per sequence per step with --speculate, in [1, 16]."),
    draft_model: Path | None = typer.Option(None, "--draft-model", help="The draft model of --speculate draft (HF directory or "
                                            ".gguf, the model's tokenizer); every rank holds it, with a cache sharded like the model's."),
    shared_memory: bool = typer.Option(True, "--shared-memory/--no-shared-memory", help="Ranks on this host combine through "
                                       "shared memory (one round, no sockets); --no-shared-memory: through gloo."),
    decode_step: DecodeStep = typer.Option(DecodeStep.dynamic, "--decode-step", help="Decode-only steps: dynamic (exact sizes), "
                                           "static (fixed shapes per batch bucket, no host synchronization; method allreduce by "
                                           "default) or graph (static steps replayed from CUDA graphs: a CUDA model only)."),
    api_key: str | None = typer.Option(None, "--api-key", envvar="TREEATTN_API_KEY",
                                       help="Require 'Authorization: Bearer KEY' on every endpoint but /health."),
    served_model_name: str | None = typer.Option(None, "--served-model-name", help="The model id clients name (default: the file or directory name)."),
    max_pending: int = typer.Option(256, "--max-pending", min=1, help="Requests (choices) in flight at most; more get 429 "
                                    "(a request asking alone for more: 400)."),
    max_request_bytes: int = typer.Option(4 << 20, "--max-request-bytes", min=1, help="Largest request body taken, in bytes; "
                                          "larger ones get 413."),
    body_timeout: float = typer.Option(10.0, "--body-timeout", min=0.001, help="Seconds a client may take to send a "
                                       "request's body after its headers; then 408."),
    timeout: float = typer.Option(60.0, "--timeout", min=0.001, help="Seconds a rank may stay silent before the engine fails."),
    drain: float = typer.Option(30.0, "--drain", min=0.0, help="Seconds to let running requests finish after SIGTERM."),
) -> None:
    """Serve MODEL over an OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, /v1/models, /health, /metrics)."""
    import torch

    from treeattn.serve.server import ServeOptions, serve

    if not model.exists():
        _fail(f"MODEL: no such file or directory: {model}")
    under_torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    if decode is Decode.local and nproc > 1 and not under_torchrun:
        _fail(f"--decode local runs on one rank, but --nproc {nproc}; use --decode tree or ring")
    try:
        options = ServeOptions(host=host, port=port, model_name=served_model_name, api_key=api_key, max_pending=max_pending,
                               drain_s=drain, max_request_bytes=max_request_bytes, body_timeout_s=body_timeout)
    except ValueError as exc:
        _fail(str(exc))
    engine_options = dict(nproc=nproc, decode=decode.value, method=method.value if method else None,
                          placement=placement.value, max_batch_size=max_batch_size, cache_tokens=cache_tokens, max_context=max_context,
                          prefix_cache=prefix_cache, block_size=block_size, prefill=prefill.value, dtype=getattr(torch, dtype.value), timeout_s=timeout,
                          speculate=None if speculate is Speculate.none else speculate.value, draft_tokens=draft_tokens,
                          draft_model=None if draft_model is None else str(draft_model), shared_memory=shared_memory,
                          decode_step=decode_step.value)

    def ready(bound_host: str, bound_port: int) -> None:
        typer.echo(f"treeattn serve: {model} on http://{bound_host}:{bound_port} ({nproc} rank(s), decode {decode.value})",
                   err=True)

    try:
        status = serve(str(model), options, engine_options, on_ready=ready)
    except (ValueError, TypeError) as exc:
        from treeattn.engine.config import ConfigError
        from treeattn.engine_cli import _cli_message

        _fail(_cli_message(exc) if isinstance(exc, ConfigError) else str(exc))
    raise typer.Exit(status)


def _fail(message: str) -> None:
    typer.echo(f"treeattn serve: error: {message}", err=True)
    raise typer.Exit(2)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(typer.run(serve_command))
