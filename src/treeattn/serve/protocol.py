"""The OpenAI request bodies the server takes, and its error bodies.

Requests are pydantic models in strict mode: a field of the wrong type (`"max_tokens": "5"`) is an
error naming the field, as OpenAI answers it. Nothing is silently dropped: fields of OpenAI's API
or vLLM's extensions that this server does not implement (`echo`, `best_of`, `tools`, ...) are
refused by name unless they hold their no-op value, and a field nobody defines is refused by name
too (OpenAI answers "Unrecognized request argument").

Error bodies follow OpenAI's shape:

    {"error": {"message": "...", "type": "invalid_request_error", "param": "max_tokens", "code": null}}
"""

from __future__ import annotations

import json
from typing import Literal, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator

# Fields of the OpenAI API that this server does not implement: a request that sets one to anything
# but its no-op value is refused, naming it.
UNSUPPORTED = {
    "echo": (None, False), "best_of": (None, 1), "suffix": (None, ""),
    "parallel_tool_calls": (None, True, False),
    "store": (None, False), "metadata": (None, {}), "service_tier": (None, "auto", "default"),
    "modalities": (None, ["text"]), "audio": (None,), "prediction": (None,), "reasoning_effort": (None,),
    "web_search_options": (None,),
    # vLLM's extensions
    "use_beam_search": (None, False), "length_penalty": (None, 1, 1.0), "min_tokens": (None, 0),
    "include_stop_str_in_output": (None, False), "skip_special_tokens": (None, True),
    "spaces_between_special_tokens": (None, True), "allowed_token_ids": (None,), "bad_words": (None, []),
    "truncate_prompt_tokens": (None,), "prompt_logprobs": (None,), "add_special_tokens": (None, False),
    "guided_json": (None,), "guided_regex": (None,), "guided_choice": (None,), "guided_grammar": (None,),
    "guided_decoding_backend": (None,), "guided_whitespace_pattern": (None,),
    "documents": (None,), "mm_processor_kwargs": (None,), "priority": (None, 0), "request_id": (None,),
    "logits_processors": (None,), "return_tokens_as_token_ids": (None, False), "kv_transfer_params": (None,),
    "vllm_xargs": (None,), "cache_salt": (None,), "prompt_embeds": (None,),
}

# Fields read from the request's extra fields by their own modules, which check them and name them
# in their errors: structured outputs (treeattn.serve.structured) and tool calls (treeattn.serve.tools).
HANDLED_ELSEWHERE = frozenset({"response_format", "structured_outputs", "tools", "tool_choice", "functions", "function_call"})


# The most prompts one /v1/completions request may batch (each is at least one choice, and a server
# runs at most --max-pending choices at once).
MAX_BATCH_PROMPTS = 4096


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    include_usage: bool = False


class _Sampling(BaseModel):
    """Fields shared by both endpoints (OpenAI's names; top_k is vLLM's extension)."""

    model_config = ConfigDict(extra="allow", strict=True)

    model: str
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: Union[str, list[str], None] = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # vLLM's extensions from here on
    min_p: float = 0.0
    logit_bias: dict[str, float] | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None

    def unsupported_field(self) -> tuple[str, str] | None:
        """(name, message) of the first field the request sets that this server does not implement
        (to anything but its no-op value), or that nobody defines; None when there is none."""
        for name, value in (self.model_extra or {}).items():
            if name in HANDLED_ELSEWHERE:
                continue
            if name not in UNSUPPORTED:
                return name, (f"unknown field '{_shown(name)}': not a field of OpenAI's API or of the vLLM extensions this "
                              f"server takes")
            if not any(value == noop and type(value) is type(noop) or value is noop for noop in UNSUPPORTED[name]):
                return name, f"'{name}' is not supported by this server"
        return None


class CompletionRequest(_Sampling):
    """POST /v1/completions. prompt: a string, a list of token ids, or a list of either (a batch).
    logprobs: None, or k: each token's log-probability and the k most likely alternatives.
    echo: the answer's text and logprobs begin with the prompt's (OpenAI's legacy echo; with
    logprobs, the prompt tokens' too, the first one's None). prompt_logprobs: None, or k: vLLM's
    per-prompt-token logprobs, in the choice's "prompt_logprobs" (treeattn.serve.echo)."""

    prompt: Union[str, list[int], list[str], list[list[int]]]
    logprobs: int | None = None
    echo: bool = False
    prompt_logprobs: int | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _batch_size(cls, prompt):
        """A batch longer than MAX_BATCH_PROMPTS is refused before its items are validated (a 4 MiB
        body of 700,000 one-token prompts would otherwise hold the event loop for seconds)."""
        if isinstance(prompt, list) and len(prompt) > MAX_BATCH_PROMPTS and isinstance(prompt[0], (str, list)):
            raise ValueError(f"a batch holds at most {MAX_BATCH_PROMPTS} prompts, got {len(prompt)}")
        return prompt

    def logprobs_asked(self) -> int | None:
        return self.logprobs


def _shown(text: str, limit: int = 80) -> str:
    """A client's string in an error message: at most `limit` characters (then "...")."""
    return text if len(text) <= limit else text[:limit] + "..."


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: Union[str, list[dict], None] = None
    name: str | None = None
    tool_calls: list[dict] | None = None  # an assistant's calls (OpenAI's shape), rendered by templates with tools
    tool_call_id: str | None = None  # a tool message: the call it answers

    def text(self) -> str:
        """The content as text: a string, or the concatenated text parts of a list ("" for an
        assistant message that carries only tool calls)."""
        if self.content is None:
            if self.role == "assistant" and self.tool_calls:
                return ""
            raise ValueError(f"a {self.role} message needs 'content' (only an assistant message with tool_calls may omit it)")
        if isinstance(self.content, str):
            return self.content
        parts = []
        for j, part in enumerate(self.content):
            kind = part.get("type")
            if kind != "text":
                raise ValueError(f"content part {j}: only text content parts are supported, got type {_shown(repr(kind), 40)}")
            if not isinstance(part.get("text"), str):
                raise ValueError(f"content part {j}: a text part needs a string 'text', got {_shown(repr(part.get('text')), 40)}")
            parts.append(part["text"])
        return "".join(parts)

    def chars(self) -> int:
        """The characters of its text (0 for parts that are not text: text() refuses those) and of its tool calls' JSON."""
        calls = len(json.dumps(self.tool_calls)) if self.tool_calls else 0
        if self.content is None or isinstance(self.content, str):
            return calls + len(self.content or "")
        return calls + sum(len(p["text"]) for p in self.content if isinstance(p.get("text"), str))


class ChatCompletionRequest(_Sampling):
    """POST /v1/chat/completions. logprobs: each token's log-probability; top_logprobs: k most
    likely alternatives with each (needs logprobs)."""

    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool | None = None
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict | None = None

    def logprobs_asked(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class APIError(Exception):
    """An error answered to the client: HTTP status and an OpenAI error body."""

    def __init__(self, status: int, message: str, *, param: str | None = None, kind: str = "invalid_request_error",
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.body = {"error": {"message": message, "type": kind, "param": param, "code": code}}


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)
