"""The OpenAI-compatible HTTP API over a ta.Engine, as a FastAPI application.

    app = create_app(engine, ServerConfig(model_name="smollm2"), chat_template=template)
    # POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET /health, GET /metrics

Each choice of a request (n per prompt) is one engine request. Events come from the engine's
driver thread through `on_event` and are handed to the event loop with call_soon_threadsafe. With
n > 1 the first choice of a prompt is submitted alone and the others once it has its first token:
by then the prompt's blocks are in the engine's prefix cache, so the prompt is prefilled once and
its K/V shared by every choice (with the prefix cache off, all are submitted at once).

Admission: a request whose choices would take the engine past `max_pending` choices in flight is
answered 429 at once, one that asks for more choices than `max_pending` (it could never run) 400;
while the engine is unhealthy every endpoint but /health answers 503. A client that disconnects
cancels its choices at once (a task waits for the disconnect), which frees their blocks; /metrics
counts the request in treeattn_requests_cancelled_total.

Hostile input: the body is limited to `max_request_bytes` (413); prompts are tokenized and chat
templates rendered in a worker thread, never on the event loop, and a text prompt that could never
fit the context is refused before it is tokenized; every error, whatever raised it (routing, a
body that is not JSON or not UTF-8, a lone surrogate, an exception of ours), has OpenAI's shape and
carries neither a traceback nor a file path; metrics are labelled by route template ("unmatched"
for paths no route knows), so random paths cannot grow /metrics.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import secrets
import threading
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

from treeattn.engine.errors import EngineError
from treeattn.engine.request import MAX_LOGPROBS, SamplingParams, TokenEvent, TokenLogprob
from treeattn.serve import echo
from treeattn.serve.access_log import USAGE, AccessLog
from treeattn.serve.metrics import CONTENT_TYPE, ServerMetrics
from treeattn.serve.protocol import APIError, ChatCompletionRequest, CompletionRequest, _shown, bad_request
from treeattn.serve.structured import structured_output
from treeattn.serve.tools import ToolRequest, check_no_tools, template_messages, tool_request

logger = logging.getLogger(__name__)

# Default max_tokens of /v1/completions when the request gives none (OpenAI's legacy default).
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
# SamplingParams field -> the request field named in errors.
_PARAM_NAMES = {"max_new_tokens": "max_tokens"}
# chat_template_kwargs that would replace what the server gives the template.
_RESERVED_TEMPLATE_VARIABLES = ("messages", "add_generation_prompt", "bos_token", "eos_token", "tools")


@dataclass(frozen=True)
class ServerConfig:
    """What the HTTP layer needs beyond the engine.

    Attributes:
        model_name: the id clients must name in "model" (and that /v1/models lists first; answers carry it).
        aliases: other ids clients may name (vLLM's --served-model-name A B: A is model_name, B an alias).
        api_key: when set, every endpoint but /health needs "Authorization: Bearer <api_key>".
        max_pending: choices in the engine at once (running and queued); more are answered 429 (a
            request that alone asks for more: 400).
        max_request_bytes: the largest request body taken; a larger one is answered 413.
        body_timeout_s: seconds a client may take to send a request's body once its headers came;
            then 408 and the connection is closed.
    """

    model_name: str
    api_key: str | None = None
    aliases: tuple[str, ...] = ()
    max_pending: int = 256
    max_request_bytes: int = 4 << 20
    body_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        if not isinstance(self.model_name, str) or not self.model_name:
            raise ValueError(f"model_name must be a non-empty string, got {self.model_name!r}")
        if not isinstance(self.aliases, tuple) or not all(isinstance(a, str) and a for a in self.aliases):
            raise ValueError(f"aliases must be a tuple of non-empty strings, got {self.aliases!r}")
        if self.api_key is not None and (not isinstance(self.api_key, str) or not self.api_key):
            raise ValueError("api_key must be a non-empty string or None")
        if isinstance(self.max_pending, bool) or not isinstance(self.max_pending, int) or self.max_pending < 1:
            raise ValueError(f"max_pending must be an int >= 1, got {self.max_pending!r}")
        if isinstance(self.max_request_bytes, bool) or not isinstance(self.max_request_bytes, int) or self.max_request_bytes < 1:
            raise ValueError(f"max_request_bytes must be an int >= 1, got {self.max_request_bytes!r}")
        if isinstance(self.body_timeout_s, bool) or not isinstance(self.body_timeout_s, (int,
                                                                                         float)) or not self.body_timeout_s > 0:
            raise ValueError(f"body_timeout_s must be a number > 0, got {self.body_timeout_s!r}")


@dataclass
class _Choice:
    index: int
    prompt: list[int]
    params: SamplingParams
    leader: int | None = None  # index of the choice whose first token releases this one (n > 1)
    counts_prompt: bool = True  # the prompt's first choice: /metrics counts the prompt's tokens with it (once, as usage)
    handle: object = None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per token when the request asked
    text: str = ""
    finish_reason: str | None = None
    error: str | None = None
    streamed: int = 0  # tokens whose logprobs a streamed chunk has carried
    streamed_chars: int = 0  # the length of those tokens' strings (the next text_offset)
    last_token_at: float | None = None  # when the server got its last token (vllm:inter_token_latency_seconds)
    prompt_logprobs: list | None = None  # RequestResult.prompt_logprobs when the request asked (echo, prompt_logprobs)


def create_app(engine, config: ServerConfig, *, chat_template=None, eot_ids: tuple[int, ...] = ()) -> FastAPI:
    """The FastAPI application serving `engine` (a driver ta.Engine).

    Args:
        engine: a started ta.Engine (engine.is_driver); the app never closes it.
        config: ServerConfig.
        chat_template: the model's treeattn.models.chat.ChatTemplate, or None (then
            /v1/chat/completions answers 400).
        eot_ids: token ids that end an assistant turn (the template's end-of-turn token).
    """
    app = FastAPI(title="treeattn", description="OpenAI-compatible API over a sequence-sharded KV cache")
    server = _Server(engine, config, chat_template, eot_ids)
    app.state.server = server

    def answer(request: Request, error: APIError) -> JSONResponse:
        server.metrics.requests.labels(_route(app, request.scope), str(error.status)).inc()
        return _ErrorResponse(error.body, status_code=error.status)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return answer(request, exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        return answer(request, _validation_message(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        return answer(request, _http_message(exc, request, config))

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception):  # a bug of ours: the request fails, not the server
        logger.exception("%s %s failed", request.method, _route(app, request.scope))
        return answer(request, APIError(500, f"internal error ({type(exc).__name__}); the server log has the details",
                                        kind="server_error"))

    def authorize(request: Request) -> JSONResponse | None:
        """None when the request may go on, else its 401 answer."""
        if config.api_key is None or request.url.path == "/health":
            return None
        header = request.headers.get("authorization", "")
        if secrets.compare_digest(header.encode(), f"Bearer {config.api_key}".encode()):
            return None
        message = "missing API key" if not header else "invalid API key"
        return answer(request, APIError(401, f"{message}: send 'Authorization: Bearer <key>'",
                                        kind="authentication_error", code="invalid_api_key"))

    # Plain ASGI middleware (not @app.middleware, whose task group would wrap the body's errors).
    app.add_middleware(_Guard, authorize=authorize, max_bytes=config.max_request_bytes, timeout_s=config.body_timeout_s)
    app.add_middleware(AccessLog)  # added last: the outermost, it logs every answer (treeattn.serve.access_log)

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health():
        if not engine.healthy:
            why = getattr(engine, "failure", None) or "the engine or one of its ranks has failed"
            return JSONResponse({"status": "unhealthy", "error": why}, status_code=503)
        return {"status": "ok"}

    @app.api_route("/metrics", methods=["GET", "HEAD"])
    async def metrics():
        return Response(server.metrics.render(), media_type=CONTENT_TYPE)

    @app.api_route("/v1/models", methods=["GET", "HEAD"])
    async def models():
        return {"object": "list", "data": [{"id": name, "object": "model", "created": server.created, "owned_by": "treeattn",
                                            "max_model_len": engine.max_context} for name in (config.model_name,
                                                                                              *config.aliases)]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        server.check_request(body, count=len(_batch(body.prompt)))
        prompts = await run_in_threadpool(server.completion_prompts, body.prompt)  # tokenizing takes time: not on the loop
        await run_in_threadpool(structured_output, body, server.engine)  # checked off the loop; _params finds it cached
        default = COMPLETIONS_DEFAULT_MAX_TOKENS
        return await server.respond(request, body, prompts, default, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        server.check_request(body, count=1)
        server.check_chat(body)  # bounded before the template and the tokenizer run
        prompts = [await run_in_threadpool(server.chat_prompt, body)]
        await run_in_threadpool(structured_output, body, server.engine, server.tools_of(body))  # _params finds it cached
        return await server.respond(request, body, prompts, None, chat=True)

    from treeattn.serve.tokenize import add_tokenizer_routes

    add_tokenizer_routes(app, server)
    return app


class _Server:
    """The endpoints' shared logic: validation, submission, events, response bodies."""

    def __init__(self, engine, config: ServerConfig, chat_template, eot_ids) -> None:
        self.engine, self.config, self.chat_template = engine, config, chat_template
        self.eot_ids = tuple(eot_ids)
        self.metrics = ServerMetrics(engine, config.model_name)
        self.created = int(time.time())
        self.max_token_chars = _max_token_chars(engine.tokenizer)
        self._pending = 0
        self._lock = threading.Lock()

    # ---------------------------------------------------------------- validation

    def check_request(self, body, count: int) -> None:
        """Everything that can be checked before any work; `count`: the prompts of the request."""
        _check_unicode(body)
        if not self.engine.healthy:
            raise APIError(503, "the engine has failed (a rank died or stopped answering); see /health",
                           kind="server_error")
        if body.model != self.config.model_name and body.model not in self.config.aliases:
            raise APIError(404, f"the model '{_shown(body.model)}' does not exist; this server serves '{self.config.model_name}'",
                           param="model", code="model_not_found")
        if isinstance(body, ChatCompletionRequest):
            self.tools_of(body)  # checked before any work
        else:
            check_no_tools(body)
        unsupported = body.unsupported_field()
        if unsupported is not None:
            raise bad_request(unsupported[1], _shown(unsupported[0]))
        if body.n < 1 or body.n > 64:
            raise bad_request(f"n must be an integer in [1, 64], got {body.n}", "n")
        if count * body.n > self.config.max_pending:  # could never be admitted: not a 429 to retry
            what = f"n={body.n}" if count == 1 else f"{count} prompts x n={body.n}"
            raise bad_request(f"this request asks for {count * body.n} completions ({what}); this server runs at most "
                              f"{self.config.max_pending} at once (--max-pending)", "n" if count == 1 else "prompt")
        _check_logprobs(body)
        if isinstance(body, CompletionRequest) and body.echo and body.stream:
            raise bad_request("'echo' is not supported with 'stream': true on this server", "echo")

    def tools_of(self, body) -> ToolRequest | None:
        """A chat request's tools, checked (treeattn.serve.tools); None for completions or a request without tools."""
        return tool_request(body, self.chat_template) if isinstance(body, ChatCompletionRequest) else None

    def completion_prompts(self, prompt) -> list[list[int]]:
        prompt = _batch(prompt)
        if not prompt:
            raise bad_request("prompt must not be empty", "prompt")
        return [self._encode(p) for p in prompt]

    def check_chat(self, body: ChatCompletionRequest) -> None:
        """What a chat request asks of the template, and its size, checked on the event loop before
        any rendering or tokenizing (cheap: a sum of lengths)."""
        if self.chat_template is None or self.engine.tokenizer is None:
            raise bad_request("this model has no chat template; use /v1/completions", "messages")
        if body.chat_template is not None:
            raise bad_request("'chat_template': this server renders the model's own chat template; a template sent "
                              "with the request is not run", "chat_template")
        if body.continue_final_message and body.add_generation_prompt:
            raise bad_request("continue_final_message continues the last message: it needs add_generation_prompt: false",
                              "continue_final_message")
        reserved = [k for k in (body.chat_template_kwargs or {}) if k in _RESERVED_TEMPLATE_VARIABLES]
        if reserved:
            raise bad_request(f"chat_template_kwargs cannot set '{reserved[0]}' (the server gives it)", "chat_template_kwargs")
        chars = sum(m.chars() for m in body.messages)
        if chars > self._max_prompt_chars():
            raise bad_request(f"the messages hold {chars} characters, more than {self.engine.max_context} tokens "
                              f"(this server's context) can hold", "messages")

    def _max_prompt_chars(self) -> int:
        """Each token covers at most max_token_chars characters (twice that, for normalizers that drop some):
        a longer text has more tokens than the context holds whatever it says, so it is refused untokenized."""
        return 2 * self.max_token_chars * self.engine.max_context

    def chat_prompt(self, body: ChatCompletionRequest) -> list[int]:
        from treeattn.models.chat import ChatTemplateError

        try:
            conversation = template_messages(body.messages, self.chat_template)
            tools = self.tools_of(body)
            variables = {**(body.chat_template_kwargs or {}), **({"tools": tools.template_tools()} if tools else {})}
            text = self.chat_template.render(conversation, add_generation_prompt=body.add_generation_prompt,
                                             variables=variables)
        except ChatTemplateError as exc:  # named without the template's path
            raise bad_request(f"the model's chat template ({exc.template_name}): {exc.reason}", "messages") from None
        except ValueError as exc:
            raise bad_request(str(exc), "messages") from None
        if body.continue_final_message:
            text = _continued(text, conversation[-1]["content"])
        if len(text) > self._max_prompt_chars():
            raise bad_request(f"the rendered conversation has {len(text)} characters, more than {self.engine.max_context} "
                              "tokens (this server's context) can hold", "messages")
        ids = self.engine.tokenizer.encode(text, add_special_tokens=False).ids  # the template writes the special tokens
        return self._check_ids(ids, "messages")

    def _encode(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.engine.tokenizer is None:
                raise bad_request("this model has no tokenizer: send the prompt as a list of token ids", "prompt")
            if len(prompt) > self._max_prompt_chars():  # refused untokenized
                raise bad_request(f"the prompt has {len(prompt)} characters, more than {self.engine.max_context} tokens "
                                  f"(this server's context) can hold", "prompt")
            ids = self.engine.tokenizer.encode(prompt).ids
        else:
            ids = list(prompt)
        return self._check_ids(ids, "prompt")

    def _check_ids(self, ids: list[int], field: str) -> list[int]:
        vocab, context = self.engine.model_info.vocab_size, self.engine.max_context
        if not ids:
            raise bad_request(f"{field}: the prompt must hold at least one token", field)
        if len(ids) >= context:
            raise bad_request(f"the prompt has {len(ids)} tokens; this server holds {context} tokens per request "
                              "(the model's window and the KV cache)", field)
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise bad_request(f"prompt token ids must be in [0, {vocab}), got {bad}", field)
        return ids

    def _params(self, body, prompt_len: int, default_max: int | None, chat: bool, index: int) -> SamplingParams:
        context = self.engine.max_context
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        if max_tokens is None:
            max_tokens = min(default_max, context - prompt_len) if default_max is not None else context - prompt_len
        elif max_tokens < 1:
            raise bad_request(f"max_tokens must be >= 1, got {max_tokens}", "max_tokens")
        elif prompt_len + max_tokens > context:
            raise bad_request(f"max_tokens={max_tokens} with a prompt of {prompt_len} tokens needs {prompt_len + max_tokens} "
                              f"positions; at most {context} fit (max_tokens <= {context - prompt_len})", "max_tokens")
        seed = body.seed + index if body.seed is not None else secrets.randbelow(1 << 31)
        stop = body.stop if body.stop is not None else ()
        stop_ids = tuple(body.stop_token_ids or ()) + (self.eot_ids if chat and not body.ignore_eos else ())
        try:
            return SamplingParams(max_new_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p,
                                  top_k=body.top_k, seed=seed, stop=stop, stop_token_ids=tuple(dict.fromkeys(stop_ids)),
                                  logprobs=body.logprobs_asked(), ignore_eos=body.ignore_eos,
                                  presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty,
                                  repetition_penalty=body.repetition_penalty, min_p=body.min_p,
                                  logit_bias=self._logit_bias(body.logit_bias),
                                  structured=structured_output(body, self.engine, self.tools_of(body)),
                                  prompt_logprobs=None if chat else echo.prompt_logprobs_asked(body))
        except ValueError as exc:
            name = str(exc).split(" ", 1)[0].rstrip(":")
            raise bad_request(str(exc).replace(name, _PARAM_NAMES.get(name, name), 1), _PARAM_NAMES.get(name, name)) from None

    def _logit_bias(self, bias: dict[str, float] | None) -> dict[int, float]:
        """OpenAI's logit_bias (token ids as JSON keys: decimal strings) as {id: bias}, ids in the vocabulary."""
        out, vocab = {}, self.engine.model_info.vocab_size
        for key, value in (bias or {}).items():
            if not (key.isascii() and key.isdigit()) or int(key) >= vocab:
                raise bad_request(f"logit_bias: keys must be token ids in [0, {vocab}), got '{_shown(key, 40)}'", "logit_bias")
            out[int(key)] = value
        return out

    # ---------------------------------------------------------------- running a request

    def _choices(self, body, prompts: list[list[int]], default_max: int | None, chat: bool) -> list[_Choice]:
        vocab = self.engine.model_info.vocab_size
        bad = next((t for t in body.stop_token_ids or () if not 0 <= t < vocab), None)
        if bad is not None:
            raise bad_request(f"stop_token_ids must be token ids in [0, {vocab}), got {bad}", "stop_token_ids")
        choices = []
        share = self.engine.config.prefix_cache and body.n > 1
        for p, prompt in enumerate(prompts):
            for i in range(body.n):
                index = p * body.n + i
                params = self._params(body, len(prompt), default_max, chat, index)
                leader = p * body.n if share and i > 0 else None
                choices.append(_Choice(index, prompt, params, leader, counts_prompt=i == 0))
        return choices

    def _admit(self, count: int) -> None:
        with self._lock:
            if self._pending + count > self.config.max_pending:
                raise APIError(429, f"the server is at capacity ({self._pending} requests in flight, at most "
                                    f"{self.config.max_pending}); retry later", kind="rate_limit_error")
            self._pending += count

    def _release(self, count: int) -> None:
        with self._lock:
            self._pending -= count

    async def respond(self, request: Request, body, prompts, default_max, *, chat: bool):
        choices = self._choices(body, prompts, default_max, chat)
        self._admit(len(choices))
        run = _Run(self, choices, asyncio.get_running_loop(), chat)
        run.usage = request.scope.get(USAGE)  # the access line's numbers (None without the AccessLog middleware)
        if run.usage is not None:
            run.usage["prompt_tokens"] = sum(len(p) for p in prompts)
        try:
            run.start()
        except Exception:
            run.cancel()
            self._release(len(choices))
            raise
        route = _route(request.app, request.scope)
        if body.stream:
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            stream = self._stream(run, body, prompts, chat, include_usage, route)
            self.metrics.requests.labels(route, "200").inc()
            return StreamingResponse(stream, media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        watcher = asyncio.create_task(run.watch_disconnect(request))
        try:
            async for _ in run.events():
                pass
        finally:
            watcher.cancel()
            run.cancel()
            self._release(len(choices))
        if run.disconnected:  # nobody reads the answer; 499 as nginx logs it
            self.metrics.requests.labels(route, "499").inc()
            self.metrics.cancelled.labels(route).inc()
            return Response(status_code=499)
        failed = next((c for c in choices if c.finish_reason == "error"), None)
        if failed is not None:
            raise self._failure(failed.error)
        self.metrics.requests.labels(route, "200").inc()
        return JSONResponse(self._body(run, body, prompts, chat))

    def _failure(self, error: str | None) -> APIError:
        """A choice's error as an answer: 503 when the engine failed or a rank failed under the step (the
        server cannot serve it now: retry, elsewhere or after the restart), 500 for this request's own."""
        if not self.engine.healthy or (error or "").startswith("engine failed"):
            return APIError(503, f"the engine failed: {_first_line(error)}", kind="server_error")
        if (error or "").startswith("a step with this request failed on the engine's ranks"):  # the driver's words (_recover)
            return APIError(503, _first_line(error), kind="server_error")
        return APIError(500, f"generation failed: {_first_line(error)}", kind="server_error")

    async def _stream(self, run: "_Run", body, prompts, chat: bool, include_usage: bool, route: str) -> AsyncIterator[str]:
        created, model = int(time.time()), self.config.model_name
        kind = "chat.completion.chunk" if chat else "text_completion"
        tools = self.tools_of(body)
        parsers = {c.index: tools.stream() for c in run.choices} if tools is not None else {}
        done = False
        try:
            if chat:
                for choice in run.choices:
                    yield _sse(_chunk(run.id, kind, created, model, choice.index, chat, role=True))
            async for choice, event in run.events():
                if event.finish_reason == "error":
                    yield _sse({"error": {"message": f"generation failed: {_first_line(event.error)}", "type": "server_error",
                                          "param": None, "code": None}})
                    continue
                for chunk in self._stream_chunks(run, body, choice, event, parsers.get(choice.index), chat, created, kind):
                    yield _sse(chunk)
            if include_usage:
                yield _sse({"id": run.id, "object": kind, "created": created, "model": model, "choices": [],
                            "usage": _usage(run.choices, prompts)})
            yield "data: [DONE]\n\n"
            done = True
        finally:  # normal end, or the client went away (starlette cancels the stream): cancel what still runs
            run.cancel()
            self._release(len(run.choices))
            if not done:
                self.metrics.cancelled.labels(route).inc()

    def _stream_chunks(self, run: "_Run", body, choice: _Choice, event, parser, chat: bool, created: int, kind: str):
        """The chunks one event of `choice` makes: its text as one chunk, or through the tool-call parser
        (treeattn.serve.tools.ToolCallStream) as content and tool_calls deltas; the last carries the finish_reason."""
        if parser is None:
            if not (event.text or event.finished):
                return []
            deltas = [{"content": event.text} if event.text else {}] if chat else [event.text]
        else:
            deltas = parser.feed(event.text) + (parser.finish() if event.finished else [])
            if event.finished and not deltas:
                deltas = [{}]
        reason = _openai_reason(event.finish_reason) if event.finished else None
        if parser is not None and reason == "stop" and parser.made_calls() and parser.tools.choice in ("auto", "required"):
            reason = "tool_calls"
        chunks = []
        for j, delta in enumerate(deltas):
            last = j == len(deltas) - 1
            logprobs = self._streamed_logprobs(choice, chat) if body.logprobs_asked() is not None and last else None
            chunks.append(_chunk(run.id, kind, created, self.config.model_name, choice.index, chat,
                                 text=delta if not chat else "",
                                 delta=delta if chat else None, reason=reason if last else None, logprobs=logprobs))
        return chunks

    def _body(self, run: "_Run", body, prompts, chat: bool) -> dict:
        choices = []
        tools = self.tools_of(body)
        for c in run.choices:
            reason = _openai_reason(c.finish_reason)
            logprobs = self._logprobs(c, chat) if body.logprobs_asked() is not None else None
            if chat:
                message = {"role": "assistant", "content": c.text}
                if tools is not None:
                    content, calls = tools.parse(c.text)
                    if calls:
                        message = {"role": "assistant", "content": content, "tool_calls": calls}
                        reason = "tool_calls" if reason == "stop" and tools.choice in ("auto", "required") else reason
                choices.append({"index": c.index, "message": message,
                                "logprobs": logprobs, "finish_reason": reason, "token_ids": c.token_ids})
            else:
                choices.append({"index": c.index, "text": c.text, "logprobs": logprobs, "finish_reason": reason,
                                "token_ids": c.token_ids, **self._echo(c, body, prompts)})
        return {"id": run.id, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
                "model": self.config.model_name, "choices": choices, "usage": _usage(run.choices, prompts)}


    def _logprobs(self, choice: _Choice, chat: bool, start: int = 0, offset: int = 0) -> dict:
        """OpenAI's logprobs object for choice's tokens from `start` on: chat's {"content": [{token,
        logprob, bytes, top_logprobs}]}, or the completions' {tokens, token_logprobs, top_logprobs,
        text_offset} (each token's offset in the completion: `offset`, then the sum of the token
        strings before it, as vLLM counts it)."""
        ids, entries = choice.token_ids[start : len(choice.logprobs)], choice.logprobs[start:]
        if chat:
            return {"content": [{**self._token(t, e.logprob), "top_logprobs": [self._token(a, lp) for a, lp in e.top]}
                                for t, e in zip(ids, entries)]}
        tokens = [self._token_text(t) for t in ids]
        offsets = list(itertools.accumulate((len(t) for t in tokens[:-1]), initial=offset)) if tokens else []
        return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries],
                "top_logprobs": [{self._token_text(a): lp for a, lp in e.top} for e in entries], "text_offset": offsets}

    def _echo(self, choice: _Choice, body, prompts) -> dict:
        """A completions choice's fields with the prompt (treeattn.serve.echo): with echo its text and
        logprobs from the prompt's first token on; with prompt_logprobs vLLM's "prompt_logprobs"."""
        out, prompt = {}, prompts[choice.index // body.n]
        if body.echo:
            out["text"] = echo.echo_text(self.engine.tokenizer, _batch(body.prompt)[choice.index // body.n]) + choice.text
            if body.logprobs is not None:
                out["logprobs"] = echo.echo_logprobs(self._token_text, prompt, choice.prompt_logprobs, choice.token_ids,
                                                     choice.logprobs)
        if body.prompt_logprobs is not None:
            out["prompt_logprobs"] = echo.vllm_prompt_logprobs(self._token_text, prompt, choice.prompt_logprobs)
        return out

    def _streamed_logprobs(self, choice: _Choice, chat: bool) -> dict:
        """The logprobs of the tokens no streamed chunk has carried yet (a token whose text is still
        an incomplete character comes with the next chunk)."""
        logprobs = self._logprobs(choice, chat, start=choice.streamed, offset=choice.streamed_chars)
        if not chat:
            choice.streamed_chars += sum(len(t) for t in logprobs["tokens"])
        choice.streamed = len(choice.logprobs)
        return logprobs

    def _token(self, token_id: int, logprob: float) -> dict:
        text = self._token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8", errors="replace"))}

    def _token_text(self, token_id: int) -> str:
        """One token's text (a partial UTF-8 character shows as U+FFFD, as in vLLM); without a
        tokenizer "token_id:<id>"."""
        tokenizer = self.engine.tokenizer
        return tokenizer.decode([token_id]) if tokenizer is not None else f"token_id:{token_id}"


class _Run:
    """The choices of one HTTP request in the engine; their events arrive on one asyncio queue."""

    def __init__(self, server: _Server, choices: list[_Choice], loop: asyncio.AbstractEventLoop, chat: bool = False) -> None:
        self.server, self.choices, self.loop = server, choices, loop
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"  # OpenAI's and vLLM's prefixes
        self.queue: asyncio.Queue = asyncio.Queue()
        self.disconnected = False
        self.usage = None  # access_log.Usage: counts the tokens and the first one's time
        self._started: set[int] = set()

    def start(self) -> None:
        for choice in self.choices:
            if choice.leader is None:
                self._submit(choice)

    def _submit(self, choice: _Choice) -> None:
        if choice.index in self._started:
            return
        self._started.add(choice.index)

        def on_event(event: TokenEvent, choice=choice) -> None:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, (choice, event))

        try:
            choice.handle = self.server.engine.submit(choice.prompt, choice.params, on_event=on_event,
                                                      request_id=f"{self.id}-{choice.index}")
        except ValueError as exc:
            raise bad_request(str(exc), "prompt") from None
        except EngineError as exc:  # it failed since check_request
            raise APIError(503, f"the engine failed: {_first_line(str(exc))}", kind="server_error") from None

    async def watch_disconnect(self, request: Request) -> None:
        """Wait for the client to go away (the body is read: the next ASGI message is the
        disconnect), then end events() at once: self.disconnected."""
        while (await request.receive())["type"] != "http.disconnect":
            pass
        self.disconnected = True
        self.queue.put_nowait(None)

    async def events(self) -> AsyncIterator[tuple[_Choice, TokenEvent]]:
        """(choice, event) as they come, until every choice has finished or the client has gone
        (watch_disconnect)."""
        open_choices = len(self.choices)
        while open_choices:
            item = await self.queue.get()
            if item is None:
                return
            choice, event = item
            self._record(choice, event)
            for follower in self.choices:  # the leader's first token: its prompt is cached now
                if follower.leader == choice.index:
                    self._submit(follower)
            if event.finished:
                open_choices -= 1
                if choice.handle is not None and event.finish_reason != "cancelled":
                    result = choice.handle.result(timeout=5)
                    choice.prompt_logprobs = result.prompt_logprobs
                    self.server.metrics.record_result(result, count_prompt=choice.counts_prompt)
            yield choice, event

    def _record(self, choice: _Choice, event: TokenEvent) -> None:
        if event.token_id is not None:
            choice.token_ids.append(event.token_id)
            now = time.perf_counter()
            if choice.last_token_at is not None:
                self.server.metrics.inter_token(now - choice.last_token_at)
            choice.last_token_at = now
            if self.usage is not None:
                self.usage.token(now)
        if event.logprob is not None:
            choice.logprobs.append(event.logprob)
        choice.text += event.text
        if event.finished:
            choice.finish_reason, choice.error = event.finish_reason, event.error

    def cancel(self) -> None:
        for choice in self.choices:
            if choice.handle is not None and choice.finish_reason is None:
                choice.handle.cancel()


def _check_logprobs(body) -> None:
    """completions' logprobs, chat's top_logprobs: ints in [0, MAX_LOGPROBS]; top_logprobs needs logprobs."""
    name = "top_logprobs" if hasattr(body, "top_logprobs") else "logprobs"
    k = getattr(body, name)
    if k is not None and not 0 <= k <= MAX_LOGPROBS:
        raise bad_request(f"{name} must be an integer in [0, {MAX_LOGPROBS}], got {k}", name)
    if name == "top_logprobs" and k and not body.logprobs:
        raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")


def _openai_reason(reason: str | None) -> str | None:
    return {"stop": "stop", "length": "length", "cancelled": "stop", "error": None}.get(reason, reason)


def _usage(choices: list[_Choice], prompts: list[list[int]]) -> dict:
    prompt_tokens = sum(len(p) for p in prompts)
    completion_tokens = sum(len(c.token_ids) for c in choices)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _chunk(run_id, kind, created, model, index, chat, *, role=False, text="", reason=None, logprobs=None, delta=None) -> dict:
    if chat:
        if delta is None:
            delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text else {})
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": reason}
    else:
        choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason}
    return {"id": run_id, "object": kind, "created": created, "model": model, "choices": [choice]}


def _sse(payload: dict) -> str:
    import json

    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


# What a union field takes, named in its errors (pydantic reports one error per member type).
_UNION_EXPECTED = {"prompt": "a string, a list of token ids, or a list of strings or of token-id lists",
                   "stop": "a string, a list of strings, or null", "content": "a string or a list of content parts"}
_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "dict", "list", "none", "null"})


def _validation_message(exc: RequestValidationError) -> APIError:
    """One OpenAI-style 400 for FastAPI's validation errors, naming the first bad field (never a
    union's member type: "prompt", not "prompt.str")."""
    first = exc.errors()[0] if exc.errors() else {}
    if first.get("type") == "json_invalid":
        return bad_request(f"the body is not valid JSON: {first.get('ctx', {}).get('error', first.get('msg'))}")
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    kept = [p for p in loc if p.split("[", 1)[0] not in _TYPE_TAGS and not any(ch in p for ch in "[]")]
    param = ".".join(kept) or None
    if param is None:  # the body itself: not a JSON object, or not sent as JSON
        return bad_request("the body must be a JSON object sent with 'Content-Type: application/json', got "
                           f"{type(first.get('input')).__name__ if first.get('input') is not None else 'nothing'}")
    if first.get("type") == "missing":
        return bad_request(f"'{param}' is required", param)
    given = first.get("input")
    if len(kept) < len(loc) and kept[-1] in _UNION_EXPECTED:  # a member type's error: say what the field takes
        return bad_request(f"invalid value for '{param}': expected {_UNION_EXPECTED[kept[-1]]} (got {given!r:.60})", param)
    return bad_request(f"invalid value for '{param}': {first.get('msg', 'invalid')} (got {given!r:.60})", param)


def _batch(prompt) -> list:
    """A completions prompt as a list of prompts (a string or one list of ids is a batch of one)."""
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        return [prompt]
    return list(prompt)


def _route(app: FastAPI, scope) -> str:
    """The metrics label of a request: its route's template ("/v1/completions"), never the raw
    path; "unmatched" for paths no route knows."""
    route = scope.get("route")
    if route is not None:
        return route.path
    for route in app.router.routes:
        match, _ = route.matches(scope)
        if match is not Match.NONE:
            return route.path
    return "unmatched"


def _http_message(exc: StarletteHTTPException, request: Request, config: ServerConfig) -> APIError:
    """OpenAI's error body for the HTTP errors of starlette/FastAPI (routing, body limit, body parsing)."""
    status = exc.status_code
    if status == 404:
        return APIError(404, f"no such route: {request.method} {request.url.path[:100]}", kind="invalid_request_error",
                        code="not_found")
    if status == 405:
        return APIError(405, f"method {request.method} is not allowed on {_route(request.app, request.scope)}",
                        kind="invalid_request_error", code="method_not_allowed")
    if status == 413:
        return APIError(413, f"the request body is larger than {config.max_request_bytes} bytes (--max-request-bytes)",
                        kind="invalid_request_error", code="request_too_large")
    if status == 408:
        return APIError(408, f"the request body did not arrive within {config.body_timeout_s:g} s", kind="invalid_request_error",
                        code="request_timeout")
    if status == 400:  # FastAPI could not parse the body: not UTF-8, nested too deep, ...
        return bad_request("the body is not valid JSON (UTF-8 text, nested at most a few hundred levels deep)")
    detail = exc.detail if isinstance(exc.detail, str) else "error"
    return APIError(status, detail[:200], kind="invalid_request_error" if status < 500 else "server_error")


def _check_unicode(body) -> None:
    """400 naming the field that holds a lone surrogate ("\\ud800" in the JSON): not Unicode text,
    no tokenizer or JSON encoder takes it."""
    stack = [(name, value) for name, value in body]
    while stack:
        name, value = stack.pop()
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError as exc:
                name = name.encode("utf-8", "backslashreplace").decode()  # a key may hold one too
                raise bad_request(f"'{name}' holds a lone surrogate ({value[exc.start]!r:.10} at character {exc.start}): "
                                  "not valid Unicode text", name.split("[", 1)[0].split(".", 1)[0]) from None
        elif isinstance(value, dict):
            stack += [(f"{name}.{k}", k) for k in value] + [(f"{name}.{k}", v) for k, v in value.items()]
        elif isinstance(value, (list, tuple)):
            stack += [(f"{name}[{i}]", v) for i, v in enumerate(value)]
        elif hasattr(value, "__iter__") and hasattr(value, "model_fields"):  # a nested pydantic model
            stack += [(f"{name}.{k}", v) for k, v in value]


def _max_token_chars(tokenizer) -> int:
    """The longest text one token stands for (special tokens included), >= 1; 1 without a tokenizer."""
    if tokenizer is None:
        return 1
    texts = tokenizer.decode_batch([[i] for i in range(tokenizer.get_vocab_size())], skip_special_tokens=False)
    return max(1, max((len(t) for t in texts), default=1))


class _ErrorResponse(JSONResponse):
    """An error body as ASCII JSON (non-ASCII escaped): whatever a message quotes from the request,
    it always encodes."""

    def render(self, content) -> bytes:
        import json

        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode("ascii")


class _Guard:
    """ASGI middleware: the API key (`authorize(request)` returns the 401 answer, or None), then
    the body's bounds: at most `max_bytes` (a Content-Length above it is refused before a byte is
    read; a chunked body once it grows past it), arriving within `timeout_s` of the headers. Past
    either bound the app's handlers see an HTTPException (413, 408) and answer in OpenAI's shape.
    (FastAPI's own max_body_size answers a plain-text 413 over any handler's; uvicorn bounds idle
    keep-alive connections, not a body that never comes.)"""

    def __init__(self, app, authorize, max_bytes: int, timeout_s: float) -> None:
        self.app, self.authorize, self.max_bytes, self.timeout_s = app, authorize, max_bytes, timeout_s

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        refused = self.authorize(Request(scope))
        if refused is not None:
            return await refused(scope, receive, send)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout_s
        length = dict(scope["headers"]).get(b"content-length", b"")
        declared = int(length) if length.isdigit() else None
        body_done, size = False, 0

        async def limited_receive():
            nonlocal body_done, size
            if body_done:
                return await receive()
            if declared is not None and declared > self.max_bytes:
                raise StarletteHTTPException(413)
            try:
                message = await asyncio.wait_for(receive(), timeout=max(0.0, deadline - loop.time()))
            except asyncio.TimeoutError:
                raise StarletteHTTPException(408) from None
            size += len(message.get("body", b""))
            if size > self.max_bytes:
                raise StarletteHTTPException(413)
            body_done = message["type"] != "http.request" or not message.get("more_body", False)
            return message

        await self.app(scope, limited_receive, send)



def _continued(text: str, final: str) -> str:
    """continue_final_message (vLLM's): the rendered conversation cut right after the last message's
    content, so that the answer continues it instead of opening a new turn."""
    at = text.rfind(final) if final else -1
    if at < 0:
        raise bad_request("continue_final_message: the chat template's text does not hold the last message's content "
                          "(it must be non-empty and written as it is)", "continue_final_message")
    return text[: at + len(final)]


def _first_line(text: str | None) -> str:
    """An error's first line: a rank's traceback stays in the server's log, never in a response."""
    return (text or "unknown error").strip().splitlines()[0] if (text or "").strip() else "unknown error"
