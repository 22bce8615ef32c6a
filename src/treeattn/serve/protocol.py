"""The OpenAI request bodies the server takes, and its error bodies.

Requests are pydantic models in strict mode: a field of the wrong type (`"max_tokens": "5"`) is an
error naming the field, as OpenAI answers it; fields this server does not know are ignored (as
vLLM does), fields it knows but does not implement (`best_of`, `logit_bias`, ...) are
refused by name rather than silently dropped.

Error bodies follow OpenAI's shape:

    {"error": {"message": "...", "type": "invalid_request_error", "param": "max_tokens", "code": null}}
"""

from __future__ import annotations

from typing import Literal, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator

# Fields of the OpenAI API that this server does not implement: a request that sets one to anything
# but its no-op value is refused, naming it.
UNSUPPORTED = {
    "best_of": (None, 1),
    "suffix": (None, ""), "logit_bias": (None, {}), "tools": (None, []), "functions": (None, []),
    "response_format": (None, {"type": "text"}), "presence_penalty": (None, 0), "frequency_penalty": (None, 0),
}


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

    def unsupported_field(self) -> str | None:
        """The first field this server does not implement that the request sets to a real value."""
        extra = self.model_extra or {}
        for name, noops in UNSUPPORTED.items():
            if name in extra and extra[name] not in noops:
                return name
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


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: Union[str, list[dict]]
    name: str | None = None

    def text(self) -> str:
        """The content as text: a string, or the concatenated text parts of a list."""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError(f"only text content parts are supported, got {part.get('type')!r}")
            parts.append(part["text"])
        return "".join(parts)


class ChatCompletionRequest(_Sampling):
    """POST /v1/chat/completions. logprobs: each token's log-probability; top_logprobs: k most
    likely alternatives with each (needs logprobs)."""

    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool | None = None
    top_logprobs: int | None = None

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
