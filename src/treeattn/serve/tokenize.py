"""vLLM's tokenizer routes: /tokenize, /detokenize and /tokenizer_info, with vLLM's shapes.

    POST /tokenize         {"prompt": "text", "add_special_tokens": true, "return_token_strs": false}
                           or {"messages": [...], "add_generation_prompt": true} (the chat template applied)
                           -> {"count": n, "max_model_len": L, "tokens": [ids], "token_strs": [...] or null}
    POST /detokenize       {"tokens": [ids]} -> {"prompt": "text"}
    GET  /tokenizer_info   -> {"tokenizer_class", "bos_token", "eos_token", "pad_token", "chat_template",
                               "model_max_length", "vocab_size"}

`model` is optional in the bodies, as in vLLM; when given it must be one the server serves.
lm-evaluation-harness's local-completions model probes /tokenizer_info and /tokenize and then
tokenizes with the server's own tokenizer (its "remote" tokenizer backend), so it needs nothing
beyond base_url and model.
"""

from __future__ import annotations

from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict, Field
from starlette.concurrency import run_in_threadpool

from treeattn.serve.protocol import APIError, ChatMessage, bad_request


class TokenizeRequest(BaseModel):
    """POST /tokenize: a text prompt, or chat messages rendered with the model's template."""

    model_config = ConfigDict(extra="ignore", strict=True)

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages (vLLM's)
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    model: str | None = None
    tokens: list[int] = Field(max_length=1 << 20)


def add_tokenizer_routes(app: FastAPI, server) -> None:
    """Add /tokenize, /detokenize and /tokenizer_info to `app` (server: the app's _Server)."""

    def tokenizer():
        if server.engine.tokenizer is None:
            raise bad_request("this model has no tokenizer", "prompt")
        return server.engine.tokenizer

    def check_model(name: str | None) -> None:
        config = server.config
        if name is not None and name != config.model_name and name not in config.aliases:
            raise APIError(404, f"the model '{name}' does not exist; this server serves '{config.model_name}'",
                           param="model", code="model_not_found")

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise bad_request("give either 'prompt' (a string) or 'messages'", "prompt")
        tok = tokenizer()
        if body.messages is not None:
            ids = await run_in_threadpool(_chat_ids, server, body)
        else:
            add = True if body.add_special_tokens is None else body.add_special_tokens
            ids = (await run_in_threadpool(tok.encode, body.prompt, add_special_tokens=add)).ids
        strs = [tok.id_to_token(i) for i in ids] if body.return_token_strs else None
        return {"count": len(ids), "max_model_len": server.engine.max_context, "tokens": ids, "token_strs": strs}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        check_model(body.model)
        vocab = server.engine.model_info.vocab_size
        bad = next((t for t in body.tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise bad_request(f"tokens must be ids in [0, {vocab}), got {bad}", "tokens")
        text = await run_in_threadpool(tokenizer().decode, body.tokens, skip_special_tokens=False)
        return {"prompt": text}

    @app.get("/tokenizer_info")
    async def tokenizer_info():
        return tokenizer_info_body(server)


def _chat_ids(server, body: TokenizeRequest) -> list[int]:
    """The ids of body.messages through the model's chat template (as /v1/chat/completions encodes them)."""
    from treeattn.models.chat import ChatTemplateError, encode_chat
    from treeattn.serve.tools import template_messages

    if server.chat_template is None:
        raise bad_request("this model has no chat template", "messages")
    try:
        conversation = template_messages(body.messages, server.chat_template)  # tool calls too, as chat renders them
        return encode_chat(server.engine.tokenizer, server.chat_template, conversation)
    except ChatTemplateError as exc:
        raise bad_request(f"the model's chat template ({exc.template_name}): {exc.reason}", "messages") from None
    except ValueError as exc:
        raise bad_request(str(exc), "messages") from None


def tokenizer_info_body(server) -> dict:
    """GET /tokenizer_info: the special tokens' texts, the chat template, the context (vLLM's keys)."""
    tok, template = server.engine.tokenizer, server.chat_template
    eos_ids = server.engine.model_info.eos_token_ids
    eos = tok.id_to_token(eos_ids[0]) if tok is not None and eos_ids else getattr(template, "eos_token", None)
    bos_id = server.engine.model_info.bos_token_id  # the model's own: lm-eval starts rolling windows with it
    bos = tok.id_to_token(bos_id) if tok is not None and bos_id is not None else getattr(template, "bos_token", None)
    return {"tokenizer_class": "tokenizers.Tokenizer", "bos_token": bos, "eos_token": eos,
            "pad_token": None, "chat_template": getattr(template, "template", None),
            "model_max_length": server.engine.max_context, "vocab_size": server.engine.model_info.vocab_size}
