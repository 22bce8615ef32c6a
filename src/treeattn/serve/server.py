"""Run the HTTP server: start the engine, serve the app with uvicorn, drain on SIGTERM, exit when a rank dies.

    treeattn serve MODEL --nproc 4 --port 8000                  # MODEL: HF directory or .gguf
    torchrun --nproc-per-node 4 -m treeattn serve MODEL          # rank 0 serves HTTP, the others decode

Signals: SIGTERM, SIGHUP and SIGINT stop accepting connections, let the running requests finish
(up to `drain_s` seconds, then they are cut), close the engine (its rank processes exit) and return
0. A rank that dies makes the engine unhealthy at once (the supervisor sees its process end): /health
and the API answer 503 for FAILED_LINGER_S seconds, then the server stops and returns 1.

Logging (logger "treeattn.serve.server" at INFO): the start-up's steps (the engine starting its
ranks, the engine ready and how long it took, the address it listens on); one access line per
request (treeattn.serve.access_log). `treeattn serve --log-level` sets the level; at DEBUG also the
web stack imported and the ranks started (treeattn.engine.transport). The rank processes log their
own steps at DEBUG (treeattn.parallel.spawn: process group ready; treeattn.engine.worker.rank: model
loaded, runner ready), which a rank shows only where logging is configured in it:
benchmarks/serving/serve_timeline.py does that and puts every process's steps on one timeline.

Start-up order: the options are checked, then the rank processes are started first thing
(treeattn.parallel.spawn.StartedRanks: forked for CPU ranks, so they share the server's imported
torch and treeattn instead of importing them again; spawned for CUDA ranks) and wait; the chat
template is checked, then ta.Engine is built in a thread (its checks, then its work handed to the
started ranks, which load the model) while this thread imports uvicorn and FastAPI; a GGUF file is
parsed once for the template and the engine's checks (treeattn.models.gguf.shared_readers). A
start-up that fails closes the started ranks; a server that dies takes them with it.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import logging
import signal
import threading
import time
from dataclasses import dataclass

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServeOptions:
    """Where and how to serve (the engine's own options are passed to ta.Engine as they are)."""

    host: str = "127.0.0.1"
    port: int = 8000
    model_name: str | None = None  # default: the checkpoint's file or directory name
    aliases: tuple[str, ...] = ()  # other names clients may use (--served-model-name given more than once)
    api_key: str | None = None
    max_pending: int = 256
    drain_s: float = 30.0
    max_request_bytes: int = 4 << 20
    body_timeout_s: float = 10.0
    keep_alive_s: int = 5
    log_level: str = "warning"  # uvicorn's own messages (its access log is off: treeattn.serve.access_log writes one)

    def __post_init__(self) -> None:
        if isinstance(self.port, bool) or not isinstance(self.port, int) or not 0 <= self.port <= 65535:
            raise ValueError(f"port must be an int in [0, 65535], got {self.port!r}")
        if not (isinstance(self.drain_s, (int, float)) and self.drain_s >= 0):
            raise ValueError(f"drain_s must be a number >= 0, got {self.drain_s!r}")


def serve(model, options: ServeOptions, engine_options: dict, *, on_ready=None) -> int:
    """Serve `model` until a signal or a failure; returns the process exit status (0 or 1).

    Args:
        model: checkpoint path (HF directory or .gguf) or a loaded model.
        options: ServeOptions.
        engine_options: keyword arguments of ta.Engine (nproc, decode, method, ...).
        on_ready: called with the bound (host, port) once the server accepts connections.
    """
    from treeattn.engine import EngineConfig
    from treeattn.engine.device import resolve_device
    from treeattn.parallel.spawn import StartedRanks, under_torchrun

    start = time.perf_counter()
    engine_config = EngineConfig(**engine_options)  # the options' own errors first, before the checkpoint is read
    kind = resolve_device(engine_config.device)  # --device cuda without a GPU: one line, before the checkpoint is read
    if engine_config.nproc == 1 or under_torchrun():
        return _serve(model, options, engine_options, engine_config, on_ready, start, ranks=None)
    # first: their start overlaps the checks and imports; while they wait they import the GGUF loader (this process too,
    # meanwhile)
    with StartedRanks(engine_config.nproc, device=kind, preload=("treeattn.models.gguf", "treeattn.models.gguf_cache"),
                      threads=engine_config.threads_per_rank) as ranks:
        logger.debug("started %d rank process(es) (%s)", ranks.nprocs, ranks.method)
        return _serve(model, options, engine_options, engine_config, on_ready, start, ranks)


def _serve(model, options: ServeOptions, engine_options: dict, engine_config, on_ready, start: float, ranks) -> int:
    """serve()'s body once the options are checked (engine_config: the EngineConfig built from them): `ranks`
    (a StartedRanks or None) go to ta.Engine."""
    from treeattn.models.gguf import shared_readers

    with shared_readers():  # the template, the engine's checks: one parse of a GGUF file
        template = _chat_template(model)  # a broken template fails the start-up before any rank is given work
        logger.info("starting the engine: %d rank(s), decode=%s; every rank loads %s", engine_config.nproc, engine_config.decode,
                    _default_name(model))
        engine = _started_engine(model, engine_options if ranks is None else dict(engine_options, ranks=ranks))
    if not engine.is_driver:  # under torchrun: this rank served the driver's steps until it closed
        return 0
    stats = engine.stats()
    logger.info("engine ready in %.2f s: max context %d tokens, KV cache %d blocks of %d tokens, prefix cache %s",
                time.perf_counter() - start, engine.max_context, stats["blocks_total"], engine.config.block_size,
                "on" if engine.prefix_cache is not None else "off")
    if engine.tokenizer is not None and engine.model_info.eos_token_ids:  # structured outputs: the grammar's
        # view of the vocabulary holds the GIL while it is built: before listening, not on a request
        started = time.perf_counter()
        engine.prepare_structured_outputs()
        logger.info("structured outputs ready in %.2f s (the grammar's view of the vocabulary)", time.perf_counter() - started)
    try:
        import uvicorn

        from treeattn.serve.app import ServerConfig, create_app

        eot_ids = _eot_ids(template, engine.tokenizer)
        config = ServerConfig(model_name=options.model_name or _default_name(model), aliases=options.aliases,
                              api_key=options.api_key,
                              max_pending=options.max_pending, max_request_bytes=options.max_request_bytes,
                              body_timeout_s=options.body_timeout_s)
        app = create_app(engine, config, chat_template=template, eot_ids=eot_ids)
        server = _DrainingServer(uvicorn.Config(app, host=options.host, port=options.port, log_level=options.log_level,
                                                access_log=False,
                                                timeout_graceful_shutdown=options.drain_s, lifespan="off",
                                                timeout_keep_alive=options.keep_alive_s,
                                                http=_http_protocol(options.body_timeout_s)))
        failed = threading.Event()
        watchdog = threading.Thread(target=_watch, args=(engine, server, failed), daemon=True, name="treeattn-serve-watchdog")
        watchdog.start()
        threading.Thread(target=_announce, args=(server, on_ready, start), daemon=True).start()
        server.run()
        return 1 if failed.is_set() or not engine.healthy else 0
    finally:
        engine.close()


def _started_engine(model, engine_options: dict):
    """ta.Engine(model, **engine_options), with the web stack (uvicorn, FastAPI, the app's module)
    imported while it starts: the Engine (its checks, then its ranks loading the model) is built in a
    thread of its own and this thread imports meanwhile, so the ranks' start overlaps the server's
    imports. With started ranks (engine_options["ranks"]) the import waits until they have their work:
    the engine's checks (Python, like the import) then have this process's GIL to themselves, and the
    import overlaps the ranks' model load, in processes of their own. Raises what the Engine raised
    (a ConfigError: one line). Under torchrun the Engine is built here (every rank joins the group;
    the non-drivers serve in it)."""
    from treeattn.engine import Engine
    from treeattn.parallel.spawn import under_torchrun

    if under_torchrun():
        engine = Engine(model, **engine_options)
        _import_web_stack()
        return engine
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="treeattn-serve-engine") as pool:
        started = pool.submit(Engine, model, **engine_options)
        ranks = engine_options.get("ranks")
        while ranks is not None and not ranks.given.wait(0.02) and not started.done():
            pass  # the checks first
        if started.done() and started.exception() is not None:
            return started.result()  # a refused start-up: its one line without the import's delay
        try:
            _import_web_stack()
        except BaseException:
            if started.exception() is None:
                started.result().close()  # no rank is left behind by a failed import
            raise
        return started.result()  # the Engine's own error is raised here, in the caller's thread


def _import_web_stack() -> None:
    """uvicorn, FastAPI and the app's module, and what they import on first use (FastAPI's route
    building: pydantic.v1; uvicorn's server: its h11 protocol, loops, lifespan), which would otherwise
    be imported after the engine is ready, on the way to the first 200 (about 0.3 s here)."""
    import uvicorn  # noqa: F401
    import uvicorn.lifespan.off  # noqa: F401
    import uvicorn.loops.asyncio  # noqa: F401
    import uvicorn.loops.auto  # noqa: F401
    import uvicorn.protocols.http.h11_impl  # noqa: F401
    import uvicorn.protocols.websockets.auto  # noqa: F401

    import treeattn.serve.app  # noqa: F401 -- FastAPI

    with contextlib.suppress(ImportError):  # pydantic 2's v1 shim, which FastAPI's route building imports
        import pydantic.v1  # noqa: F401
    logger.debug("web stack imported")


def _draining_server_class():
    import contextlib

    import uvicorn

    class DrainingServer(uvicorn.Server):
        """uvicorn's server, with SIGHUP handled like SIGTERM (stop accepting, drain, return) and
        without re-raising the signal afterwards, so that the engine is closed and the exit
        status says how serving ended."""

        @contextlib.contextmanager
        def capture_signals(self):
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            handled = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
            previous = {sig: signal.signal(sig, self.handle_exit) for sig in handled}
            try:
                yield
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)

        def handle_exit(self, sig, frame) -> None:
            if not self.should_exit:  # the first signal: say what happens now (a second one forces the exit)
                logger.warning("%s: no new requests; the ones in flight finish (at most --drain seconds), then the engine "
                               "closes", signal.Signals(sig).name)
            super().handle_exit(sig, frame)

    return DrainingServer


def _DrainingServer(config):  # noqa: N802 -- a class made on first use (uvicorn is imported lazily)
    return _draining_server_class()(config)


def _http_protocol(headers_timeout_s: float):
    """uvicorn's h11 protocol, closing a connection whose request line and headers have not all come
    within `headers_timeout_s` of its opening (or of its previous response): uvicorn closes idle
    keep-alive connections (timeout_keep_alive) but would hold a silent new connection, or one
    dribbling its headers, for ever. The body's own deadline is the app's (408)."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class HeadersDeadline(H11Protocol):
        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm()

        def send_400_response(self, msg: str) -> None:
            """uvicorn's answer to a request h11 cannot parse, in OpenAI's error shape: 431 when the
            request line and headers outgrew h11's limit (h11_max_incomplete_event_size), else 400."""
            import h11

            too_long = len(getattr(self.conn, "_receive_buffer", b"")) > getattr(self.conn, "_max_incomplete_event_size", 1 << 62)
            status, message, code = ((431, "the request line and headers are larger than this server takes", "headers_too_large")
                                     if too_long else (400, "the request is not valid HTTP/1.1", "invalid_http"))
            body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                         "code": code}}).encode()
            headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                       (b"connection", b"close")]
            for event in (h11.Response(status_code=status, headers=headers), h11.Data(data=body), h11.EndOfMessage()):
                self.transport.write(self.conn.send(event))
            self.transport.close()

        def _arm(self) -> None:
            waiting_for = self.cycle  # a new request replaces self.cycle

            def expire() -> None:
                if self.cycle is waiting_for and not self.transport.is_closing():
                    self.transport.close()

            self.loop.call_later(headers_timeout_s, expire)

    return HeadersDeadline


FAILED_LINGER_S = 2.0
"""After the engine fails, the server answers 503 (with the reason) this long before it stops, so that
health checks and clients see the failure rather than a refused connection."""


def _watch(engine, server, failed: threading.Event) -> None:
    """Stop the server FAILED_LINGER_S after the engine turned unhealthy (a rank died or stopped answering)."""
    while not server.should_exit:
        if not engine.healthy:
            logger.error("the engine failed (%s): stopping the server in %g s", getattr(engine, "failure", None)
                         or "a rank died or stopped answering", FAILED_LINGER_S)
            failed.set()
            threading.Event().wait(FAILED_LINGER_S)
            server.should_exit = True
            return
        threading.Event().wait(0.1)


def _announce(server, on_ready, start: float) -> None:
    while not server.started and not server.should_exit:
        threading.Event().wait(0.05)
    if server.started:
        sockets = [s for srv in server.servers for s in srv.sockets]
        host, port = sockets[0].getsockname()[:2]
        logger.info("listening on http://%s:%d, %.2f s after the start", host, port, time.perf_counter() - start)
        if on_ready is not None:
            on_ready(host, port)


def _chat_template(model):
    """The checkpoint's ChatTemplate or None. It is tried once on a user turn: a template that fails
    there (ChatTemplateError: it does not compile, raises, or runs past its bounds) stops the
    start-up with one line naming it."""
    import os

    from treeattn.models.chat import read_chat_template

    if isinstance(model, (str, os.PathLike)):
        template = read_chat_template(model)
    else:
        template = getattr(model, "chat_template", None)
    if template is not None:
        template.render([{"role": "user", "content": "hi"}])
    return template


def _eot_ids(template, tokenizer) -> tuple[int, ...]:
    """The end-of-turn ids to stop chat answers at."""
    from treeattn.models.chat import end_of_turn_id

    if template is None or tokenizer is None:
        return ()
    eot = end_of_turn_id(tokenizer, template)
    return (eot,) if eot is not None else ()


def _default_name(model) -> str:
    import os

    if isinstance(model, (str, os.PathLike)):
        name = os.path.basename(os.path.normpath(os.fspath(model)))
        return name[: -len(".gguf")] if name.endswith(".gguf") else name
    return "treeattn-model"
