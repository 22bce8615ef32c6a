"""The OpenAI-compatible HTTP API over a ta.Engine, as a FastAPI application.

    app = create_app(engine, ServerConfig(model_name="smollm2"), chat_template=template)
    # POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET /health, GET /metrics

Each choice of a request (n per prompt) is one engine request. Events come from the engine's
driver thread through `on_event` and are handed to the event loop with call_soon_threadsafe. With
n > 1 the first choice of a prompt is submitted alone and the others once it has its first token:
by then the prompt's blocks are in the engine's prefix cache, so the prompt is prefilled once and
its K/V shared by every choice (with the prefix cache off, all are submitted at once).

Admission: a request whose choices would take the engine past `max_pending` choices in flight is
answered 429 at once; while the engine is unhealthy every endpoint but /health answers 503. A
client that disconnects cancels its choices, which frees their blocks.
"""

from __future__ import annotations

import asyncio
import itertools
import secrets
import threading
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse

from treeattn.engine.request import MAX_LOGPROBS, SamplingParams, TokenEvent, TokenLogprob
from treeattn.serve.metrics import CONTENT_TYPE, ServerMetrics
from treeattn.serve.protocol import APIError, ChatCompletionRequest, CompletionRequest, bad_request

# Default max_tokens of /v1/completions when the request gives none (OpenAI's legacy default).
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
# SamplingParams field -> the request field named in errors.
_PARAM_NAMES = {"max_new_tokens": "max_tokens", "temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
                "seed": "seed", "stop": "stop"}


@dataclass(frozen=True)
class ServerConfig:
    """What the HTTP layer needs beyond the engine.

    Attributes:
        model_name: the id clients must name in "model" (and that /v1/models lists).
        api_key: when set, every endpoint but /health needs "Authorization: Bearer <api_key>".
        max_pending: choices in the engine at once (running and queued); more are answered 429.
    """

    model_name: str
    api_key: str | None = None
    max_pending: int = 256

    def __post_init__(self) -> None:
        if not isinstance(self.model_name, str) or not self.model_name:
            raise ValueError(f"model_name must be a non-empty string, got {self.model_name!r}")
        if self.api_key is not None and (not isinstance(self.api_key, str) or not self.api_key):
            raise ValueError("api_key must be a non-empty string or None")
        if isinstance(self.max_pending, bool) or not isinstance(self.max_pending, int) or self.max_pending < 1:
            raise ValueError(f"max_pending must be an int >= 1, got {self.max_pending!r}")


@dataclass
class _Choice:
    index: int
    prompt: list[int]
    params: SamplingParams
    leader: int | None = None  # index of the choice whose first token releases this one (n > 1)
    handle: object = None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per token when the request asked
    text: str = ""
    finish_reason: str | None = None
    error: str | None = None
    streamed: int = 0  # tokens whose logprobs a streamed chunk has carried
    streamed_chars: int = 0  # the length of those tokens' strings (the next text_offset)


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

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        server.metrics.requests.labels(request.url.path, str(exc.status)).inc()
        return JSONResponse(exc.body, status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        error = _validation_message(exc)
        server.metrics.requests.labels(request.url.path, "400").inc()
        return JSONResponse(error.body, status_code=400)

    @app.middleware("http")
    async def _authorize(request: Request, call_next):
        if config.api_key is not None and request.url.path != "/health":
            header = request.headers.get("authorization", "")
            if not secrets.compare_digest(header.encode(), f"Bearer {config.api_key}".encode()):
                server.metrics.requests.labels(request.url.path, "401").inc()
                message = "missing API key" if not header else "invalid API key"
                return JSONResponse(APIError(401, f"{message}: send 'Authorization: Bearer <key>'",
                                             kind="authentication_error", code="invalid_api_key").body, status_code=401)
        return await call_next(request)

    @app.get("/health")
    async def health():
        if not engine.healthy:
            return JSONResponse({"status": "unhealthy", "error": "the engine or one of its ranks has failed"}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return Response(server.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": config.model_name, "object": "model", "created": server.created,
                                            "owned_by": "treeattn", "max_model_len": engine.max_context}]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        server.check_request(body)
        prompts = server.completion_prompts(body.prompt)
        default = COMPLETIONS_DEFAULT_MAX_TOKENS
        return await server.respond(request, body, prompts, default, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        server.check_request(body)
        prompts = [server.chat_prompt(body)]
        return await server.respond(request, body, prompts, None, chat=True)

    return app


class _Server:
    """The endpoints' shared logic: validation, submission, events, response bodies."""

    def __init__(self, engine, config: ServerConfig, chat_template, eot_ids) -> None:
        self.engine, self.config, self.chat_template = engine, config, chat_template
        self.eot_ids = tuple(eot_ids)
        self.metrics = ServerMetrics(engine)
        self.created = int(time.time())
        self._pending = 0
        self._lock = threading.Lock()

    # ---------------------------------------------------------------- validation

    def check_request(self, body) -> None:
        if not self.engine.healthy:
            raise APIError(503, "the engine has failed (a rank died or stopped answering); see /health",
                           kind="server_error")
        if body.model != self.config.model_name:
            raise APIError(404, f"the model '{body.model}' does not exist; this server serves '{self.config.model_name}'",
                           param="model", code="model_not_found")
        unsupported = body.unsupported_field()
        if unsupported is not None:
            raise bad_request(f"'{unsupported}' is not supported by this server", unsupported)
        if body.n < 1 or body.n > 64:
            raise bad_request(f"n must be an integer in [1, 64], got {body.n}", "n")
        _check_logprobs(body)

    def completion_prompts(self, prompt) -> list[list[int]]:
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            prompt = [prompt]
        if not prompt:
            raise bad_request("prompt must not be empty", "prompt")
        return [self._encode(p) for p in prompt]

    def chat_prompt(self, body: ChatCompletionRequest) -> list[int]:
        if self.chat_template is None or self.engine.tokenizer is None:
            raise bad_request("this model has no chat template; use /v1/completions", "messages")
        from treeattn.models.chat import encode_chat

        try:
            conversation = [{"role": m.role, "content": m.text()} for m in body.messages]
            return encode_chat(self.engine.tokenizer, self.chat_template, conversation)
        except ValueError as exc:
            raise bad_request(str(exc), "messages") from None

    def _encode(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.engine.tokenizer is None:
                raise bad_request("this model has no tokenizer: send the prompt as a list of token ids", "prompt")
            ids = self.engine.tokenizer.encode(prompt).ids
        else:
            ids = list(prompt)
        vocab = self.engine.model_info.vocab_size
        if not ids:
            raise bad_request("prompt must hold at least one token", "prompt")
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise bad_request(f"prompt token ids must be in [0, {vocab}), got {bad}", "prompt")
        return ids

    def _params(self, body, prompt_len: int, default_max: int | None, chat: bool, index: int) -> SamplingParams:
        context = self.engine.max_context
        field = "messages" if chat else "prompt"
        if prompt_len >= context:
            raise bad_request(f"the prompt has {prompt_len} tokens; this server holds {context} tokens per request "
                              "(the model's window and the KV cache)", field)
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
        try:
            return SamplingParams(max_new_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p,
                                  top_k=body.top_k, seed=seed, stop=stop, stop_token_ids=self.eot_ids if chat else (),
                                  logprobs=body.logprobs_asked())
        except ValueError as exc:
            name = str(exc).split(" ", 1)[0]
            raise bad_request(str(exc).replace(name, _PARAM_NAMES.get(name, name), 1), _PARAM_NAMES.get(name, name)) from None

    # ---------------------------------------------------------------- running a request

    def _choices(self, body, prompts: list[list[int]], default_max: int | None, chat: bool) -> list[_Choice]:
        choices = []
        share = self.engine.config.prefix_cache and body.n > 1
        for p, prompt in enumerate(prompts):
            for i in range(body.n):
                index = p * body.n + i
                params = self._params(body, len(prompt), default_max, chat, index)
                leader = p * body.n if share and i > 0 else None
                choices.append(_Choice(index, prompt, params, leader))
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
        run = _Run(self, choices, asyncio.get_running_loop())
        try:
            run.start()
        except Exception:
            run.cancel()
            self._release(len(choices))
            raise
        path = request.url.path
        if body.stream:
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            stream = self._stream(run, body, prompts, chat, include_usage)
            self.metrics.requests.labels(path, "200").inc()
            return StreamingResponse(stream, media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        try:
            async for _ in run.events(request):
                pass
        finally:
            run.cancel()
            self._release(len(choices))
        failed = next((c for c in choices if c.finish_reason == "error"), None)
        if failed is not None:
            raise APIError(500, f"generation failed: {failed.error}", kind="server_error")
        if run.disconnected:
            return Response(status_code=499)
        self.metrics.requests.labels(path, "200").inc()
        return JSONResponse(self._body(run, body, prompts, chat))

    async def _stream(self, run: "_Run", body, prompts, chat: bool, include_usage: bool) -> AsyncIterator[str]:
        created, model = int(time.time()), self.config.model_name
        kind = "chat.completion.chunk" if chat else "text_completion"
        try:
            if chat:
                for choice in run.choices:
                    yield _sse(_chunk(run.id, kind, created, model, choice.index, chat, role=True))
            async for choice, event in run.events(None):
                if event.text or event.finished:
                    reason = _openai_reason(event.finish_reason) if event.finished else None
                    if event.finish_reason == "error":
                        yield _sse({"error": {"message": f"generation failed: {event.error}", "type": "server_error",
                                              "param": None, "code": None}})
                        continue
                    logprobs = self._streamed_logprobs(choice, chat) if body.logprobs_asked() is not None else None
                    yield _sse(_chunk(run.id, kind, created, model, choice.index, chat, text=event.text, reason=reason,
                                      logprobs=logprobs))
            if include_usage:
                yield _sse({"id": run.id, "object": kind, "created": created, "model": model, "choices": [],
                            "usage": _usage(run.choices, prompts)})
            yield "data: [DONE]\n\n"
        finally:  # normal end, or the client went away (the generator is closed): cancel what still runs
            run.cancel()
            self._release(len(run.choices))

    def _body(self, run: "_Run", body, prompts, chat: bool) -> dict:
        choices = []
        for c in run.choices:
            reason = _openai_reason(c.finish_reason)
            logprobs = self._logprobs(c, chat) if body.logprobs_asked() is not None else None
            if chat:
                choices.append({"index": c.index, "message": {"role": "assistant", "content": c.text},
                                "logprobs": logprobs, "finish_reason": reason, "token_ids": c.token_ids})
            else:
                choices.append({"index": c.index, "text": c.text, "logprobs": logprobs, "finish_reason": reason,
                                "token_ids": c.token_ids})
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

    def __init__(self, server: _Server, choices: list[_Choice], loop: asyncio.AbstractEventLoop) -> None:
        self.server, self.choices, self.loop = server, choices, loop
        self.id = f"cmpl-{uuid.uuid4().hex[:24]}"
        self.queue: asyncio.Queue = asyncio.Queue()
        self.disconnected = False
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

    async def events(self, request: Request | None) -> AsyncIterator[tuple[_Choice, TokenEvent]]:
        """(choice, event) as they come, until every choice has finished. With `request`, a client
        that disconnects ends the iteration early (self.disconnected)."""
        open_choices = len(self.choices)
        while open_choices:
            try:
                choice, event = await asyncio.wait_for(self.queue.get(), timeout=0.5)
            except asyncio.TimeoutError:
                if request is not None and await request.is_disconnected():
                    self.disconnected = True
                    return
                continue
            self._record(choice, event)
            for follower in self.choices:  # the leader's first token: its prompt is cached now
                if follower.leader == choice.index:
                    self._submit(follower)
            if event.finished:
                open_choices -= 1
                if choice.handle is not None and event.finish_reason != "cancelled":
                    self.server.metrics.record_result(choice.handle.result(timeout=5))
            yield choice, event

    def _record(self, choice: _Choice, event: TokenEvent) -> None:
        if event.token_id is not None:
            choice.token_ids.append(event.token_id)
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


def _chunk(run_id, kind, created, model, index, chat, *, role=False, text="", reason=None, logprobs=None) -> dict:
    if chat:
        delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text else {})
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": reason}
    else:
        choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason}
    return {"id": run_id, "object": kind, "created": created, "model": model, "choices": [choice]}


def _sse(payload: dict) -> str:
    import json

    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def _validation_message(exc: RequestValidationError) -> APIError:
    """One OpenAI-style 400 for FastAPI's validation errors, naming the first bad field."""
    first = exc.errors()[0] if exc.errors() else {}
    if first.get("type") == "json_invalid":
        return bad_request(f"the body is not valid JSON: {first.get('ctx', {}).get('error', first.get('msg'))}")
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    # Union fields report one error per member type: name the field, not the member.
    param = ".".join(p for p in loc if not any(ch in p for ch in "[]")) or None
    if first.get("type") == "missing":
        return bad_request(f"'{param}' is required", param)
    given = first.get("input")
    return bad_request(f"invalid value for '{param}': {first.get('msg', 'invalid')} (got {given!r:.60})", param)
