"""What a request is, what it asks for and what comes back (the engine's public data types).

    params = SamplingParams(max_new_tokens=64, temperature=0.0, top_p=1.0, top_k=0, seed=0,
                            stop_token_ids=(), stop=(), presence_penalty=0.0, frequency_penalty=0.0,
                            repetition_penalty=1.0, min_p=0.0, logit_bias={}, structured=None)
    TokenEvent     one new token of one request (or its end), as it comes
    RequestResult  the whole outcome of one request
    TokenLogprob   a token's log-probability and the most likely alternatives (params.logprobs)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from treeattn.engine.structured import StructuredOutput

FINISH_REASONS = ("stop", "length", "cancelled", "error")
MAX_SEED = 1 << 64  # seeds are in [0, MAX_SEED): what torch.Generator.manual_seed takes
MAX_LOGPROBS = 20  # most alternatives per token a request may ask for (OpenAI's top_logprobs limit)
MAX_LOGIT_BIAS = 100.0  # |bias| at most (OpenAI's range for logit_bias)
MAX_PENALTY = 2.0  # |presence_penalty|, |frequency_penalty| at most (OpenAI's and vLLM's range)


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
        presence_penalty: in [-2, 2]; subtracted from the logit of every token the output holds
            (vLLM's and OpenAI's semantics; the prompt does not count).
        frequency_penalty: in [-2, 2]; times how often a token occurs in the output, subtracted
            from its logit.
        repetition_penalty: > 0 (1: none); the logit of every token in the prompt or the output is
            divided by it when positive and multiplied by it when negative (vLLM's, after CTRL).
        min_p: in [0, 1] (0: none); after temperature, tokens whose probability is below min_p
            times the most likely token's are dropped (before top-k and top-p, as vLLM).
        logit_bias: {token_id: bias} (or (token_id, bias) pairs), bias in [-100, 100], added to
            the token's logit before anything else (ids must be in the model's vocabulary: checked
            at submission). Biases and penalties apply to greedy requests too: they move the argmax.
        structured: None, or a StructuredOutput (treeattn.engine.structured: a JSON schema, a regex, a
            choice, a grammar) that every generated token must follow; the request ends ("stop") when
            the grammar is complete. Not with ignore_eos.
        prompt_logprobs: None, or k in [0, MAX_LOGPROBS]: every prompt token but the first comes
            with its log-probability given the tokens before it and the k most likely tokens at its
            position (RequestResult.prompt_logprobs; vLLM's prompt_logprobs). Such a request does
            not start from the prefix cache (a cached prefix holds no logprobs): its whole prompt
            is computed again (treeattn.engine.worker.prompt_logprobs).

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
        >>> ta.SamplingParams(logit_bias={7: -100, 3: 2.5}, repetition_penalty=1.2).logit_bias   # sorted (id, bias) pairs
        ((3, 2.5), (7, -100.0))
        >>> try:
        ...     ta.SamplingParams(logit_bias={7: 101})
        ... except ValueError as error:
        ...     print(error)
        logit_bias: the bias of token 7 must be a number in [-100, 100], got 101
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
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    structured: StructuredOutput | None = None
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
        if self.prompt_logprobs is not None and (
            not _is_int(self.prompt_logprobs) or not 0 <= self.prompt_logprobs <= MAX_LOGPROBS
        ):
            raise ValueError(f"prompt_logprobs must be None or an int in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs!r}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        stop_ids = self.stop_token_ids
        if isinstance(stop_ids, (str, bytes)) or not hasattr(stop_ids,
                                                             "__iter__") or not all(_is_int(t) and t >= 0 for t in stop_ids):
            raise ValueError(f"stop_token_ids must be a sequence of ints >= 0, got {stop_ids!r}")
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        if stop is None:
            stop = ()
        if not hasattr(stop, "__iter__") or not all(isinstance(s, str) and s for s in stop):
            raise ValueError(f"stop must be a non-empty string or a sequence of them, got {self.stop!r}")
        object.__setattr__(self, "stop_token_ids", tuple(stop_ids))
        object.__setattr__(self, "stop", tuple(stop))
        self._check_penalties()
        if self.structured is not None and not isinstance(self.structured, StructuredOutput):
            raise ValueError(f"structured must be None or a StructuredOutput, got {type(self.structured).__name__}")
        if self.structured is not None and self.ignore_eos:
            raise ValueError(
                "structured: a structured output ends at the model's end-of-sequence token; ignore_eos must be False"
            )

    def _check_penalties(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -MAX_PENALTY <= value <= MAX_PENALTY:
                raise ValueError(f"{name} must be a number in [-2, 2] (0: none), got {value!r}")
        if not _is_number(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be a finite number > 0 (1: none), got {self.repetition_penalty!r}")
        if not _is_number(self.min_p) or not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be a number in [0, 1] (0: none), got {self.min_p!r}")
        object.__setattr__(self, "logit_bias", _logit_bias(self.logit_bias))

    @property
    def penalized(self) -> bool:
        """Whether a penalty is set (the sampler then needs the request's tokens)."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1


def _logit_bias(bias) -> tuple[tuple[int, float], ...]:
    """logit_bias as sorted (token_id, float bias) pairs: from a mapping or pairs; ValueError naming the bad entry."""
    if bias is None:
        return ()
    pairs = bias.items() if hasattr(bias, "items") else bias
    if isinstance(pairs, (str, bytes)) or not hasattr(pairs, "__iter__"):
        raise ValueError(f"logit_bias must be a mapping of token ids to biases, got {bias!r:.80}")
    out: dict[int, float] = {}
    for pair in pairs:
        if not isinstance(pair, (tuple, list)) or len(pair) != 2:
            raise ValueError(f"logit_bias must be a mapping of token ids to biases, got the entry {pair!r:.60}")
        token, value = pair
        if not _is_int(token) or token < 0:
            raise ValueError(f"logit_bias: token ids must be ints >= 0, got {token!r:.60}")
        if not _is_number(value) or not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias: the bias of token {token} must be a number in [-100, 100], got {value!r:.60}")
        if token in out:
            raise ValueError(f"logit_bias: token {token} is given twice")
        out[token] = float(value)
    return tuple(sorted(out.items()))


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
        queue_s: seconds from submission to the first step that ran it (NaN if none did).
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
    queue_s: float = float("nan")
    prompt_logprobs: list[TokenLogprob | None] | None = None
