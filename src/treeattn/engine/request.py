"""What a request is, what it asks for and what comes back (the engine's public data types).

    params = SamplingParams(max_new_tokens=64, temperature=0.0, top_p=1.0, top_k=0, seed=0,
                            stop_token_ids=(), stop=())
    TokenEvent     one new token of one request (or its end), as it comes
    RequestResult  the whole outcome of one request
    TokenLogprob   a token's log-probability and the most likely alternatives (params.logprobs)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

FINISH_REASONS = ("stop", "length", "cancelled", "error")
MAX_SEED = 1 << 64  # seeds are in [0, MAX_SEED): what torch.Generator.manual_seed takes
MAX_LOGPROBS = 20  # most alternatives per token a request may ask for (OpenAI's top_logprobs limit)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True)
class SamplingParams:
    """How to continue one prompt. Validated on construction: a bad value raises ValueError naming
    the field, what was expected and what came.

    Attributes:
        max_new_tokens: new tokens at most, >= 1.
        temperature: 0 is greedy (argmax); > 0 divides the logits before sampling.
        top_p: nucleus sampling mass in (0, 1]; 1 keeps every token.
        top_k: keep the k most likely tokens; 0 keeps every token.
        seed: seed of this request's own random generator, in [0, 2**64) (what torch.Generator
            takes): its draws do not depend on the other requests it runs with.
        stop_token_ids: token ids that end the request (with the token included in the output);
            the model's end-of-sequence ids are added by the engine unless ignore_eos.
        stop: strings that end the request when they appear in the text (needs a tokenizer);
            the text is cut before the stop string.
        ignore_eos: do not stop at the model's end-of-sequence ids.
        logprobs: None, or k in [0, MAX_LOGPROBS]: every generated token comes with its
            log-probability under the model and the k most likely tokens with theirs
            (TokenLogprob). The distribution is the model's own: log-softmax of the float32
            logits, before temperature, top-k and top-p (as vLLM and OpenAI report it).
        prompt_logprobs: None, or k in [0, MAX_LOGPROBS]: every prompt token but the first comes
            with its log-probability given the tokens before it and the k most likely tokens at its
            position (RequestResult.prompt_logprobs; vLLM's prompt_logprobs). Such a request does
            not start from the prefix cache (a cached prefix holds no logprobs): its whole prompt
            is computed again (treeattn.engine.prompt_logprobs).

    Example (checked when built: a bad field is one line naming it)::

        >>> import treeattn as ta
        >>> sampling = ta.SamplingParams(max_new_tokens=16, temperature=0.7, top_p=0.9, stop=("Q:",))
        >>> sampling.top_k, sampling.ignore_eos                       # 0: every token; stop at the model's eos ids too
        (0, False)
        >>> try:
        ...     ta.SamplingParams(top_p=0)
        ... except ValueError as error:
        ...     print(error)
        top_p must be a number in (0, 1], got 0
    """

    max_new_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        if not _is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an int >= 1, got {self.max_new_tokens!r}")
        if not _is_number(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature!r}")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be a number in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise ValueError(f"top_k must be an int >= 0 (0 = all tokens), got {self.top_k!r}")
        if not _is_int(self.seed) or not 0 <= self.seed < MAX_SEED:
            raise ValueError(f"seed must be an int >= 0 and below 2**64 (a torch.Generator seed), got {self.seed!r}")
        if self.logprobs is not None and (not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise ValueError(f"logprobs must be None or an int in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")
        if self.prompt_logprobs is not None and (not _is_int(self.prompt_logprobs) or not 0 <= self.prompt_logprobs <= MAX_LOGPROBS):
            raise ValueError(f"prompt_logprobs must be None or an int in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs!r}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        stop_ids = self.stop_token_ids
        if isinstance(stop_ids, (str, bytes)) or not hasattr(stop_ids, "__iter__") or not all(_is_int(t) and t >= 0 for t in stop_ids):
            raise ValueError(f"stop_token_ids must be a sequence of ints >= 0, got {stop_ids!r}")
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        if stop is None:
            stop = ()
        if not hasattr(stop, "__iter__") or not all(isinstance(s, str) and s for s in stop):
            raise ValueError(f"stop must be a non-empty string or a sequence of them, got {self.stop!r}")
        object.__setattr__(self, "stop_token_ids", tuple(stop_ids))
        object.__setattr__(self, "stop", tuple(stop))


@dataclass(frozen=True)
class TokenLogprob:
    """A generated token's log-probability under the model, and the most likely tokens at its position.

    Attributes:
        logprob: log p(token), a finite float (log-softmax of the float32 logits).
        top: ((token_id, logprob), ...): the k most likely tokens, most likely first (k =
            params.logprobs; the chosen token is among them only if it is that likely).
        rank: of a prompt token (SamplingParams.prompt_logprobs), 1 + the number of tokens the model
            found more likely (vLLM's rank); None for generated tokens.
    """

    logprob: float
    top: tuple[tuple[int, float], ...] = ()
    rank: int | None = None


@dataclass(frozen=True)
class TokenEvent:
    """One step of one request: a new token, or the request's end (or both).

    Attributes:
        request_id: the request's id.
        token_id: the new token, or None for an end without a token (cancelled, error).
        text: the new text this token completes ("" without a tokenizer, or while a multi-byte
            character is incomplete).
        finished: whether the request has ended.
        finish_reason: "stop", "length", "cancelled" or "error" when finished, else None.
        error: the error message when finish_reason is "error".
        logprob: the token's TokenLogprob when the request asked for logprobs, else None.
    """

    request_id: str
    token_id: int | None
    text: str = ""
    finished: bool = False
    finish_reason: str | None = None
    error: str | None = None
    logprob: TokenLogprob | None = None


@dataclass
class RequestResult:
    """The outcome of one request.

    Attributes:
        request_id: the request's id.
        token_ids: the generated tokens (a stop token included).
        text: their text ("" without a tokenizer), cut before a stop string.
        finish_reason: "stop", "length", "cancelled" or "error".
        prompt_tokens: prompt length.
        cached_prompt_tokens: prompt tokens whose keys/values came from the prefix cache.
        ttft_s: seconds from submission to the first token.
        decode_s: seconds from the first token to the last.
        error: the error message when finish_reason is "error", else None.
        speculation: {} without speculative decoding; else method, draft_tokens (k), drafted and
            accepted (draft tokens verified and kept), acceptance_rate (NaN when none was drafted),
            decoded_tokens (tokens committed by decode steps: all but the first, which the prefill
            samples, unless the prompt came whole from the prefix cache), decode_forwards (the
            model's forward passes over this request's decode steps) and tokens_per_forward.
        logprobs: one TokenLogprob per generated token when params.logprobs is set, else None.
        prompt_logprobs: when params.prompt_logprobs is set, one entry per prompt token: None for
            the first (nothing predicts it), then the TokenLogprob of token i given tokens [0, i);
            else None.

    Example (prompt log-probabilities of a tiny random model; the first token has none)::

        >>> import treeattn as ta
        >>> from treeattn.models import random_model
        >>> model = random_model(ta.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1,
        ...                                     num_heads=2, num_kv_heads=1, head_dim=16), seed=0)
        >>> with ta.Engine(model, nproc=1) as engine:
        ...     result = engine.generate([[5, 9, 2, 7]], ta.SamplingParams(max_new_tokens=1, prompt_logprobs=1))[0]
        >>> first, *rest = result.prompt_logprobs
        >>> first, len(rest), all(entry.logprob < 0 and len(entry.top) == 1 for entry in rest)
        (None, 3, True)
    """

    request_id: str
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    ttft_s: float = float("nan")
    decode_s: float = 0.0
    error: str | None = None
    speculation: dict = field(default_factory=dict)
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None
