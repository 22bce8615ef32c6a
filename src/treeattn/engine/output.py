"""The engine's output side: each request's handle, its text (detokenizing), its stop strings and its result.

    handle = RequestHandle(request_id, post, on_event)   # what Engine.submit returns
    state = RequestState(handle, prompt_ids, params, submitted=time.perf_counter())
    delta, stopped = state.add_token(token, logprob, tokenizer, now, last=False)   # the text to deliver
    result = state.result("length", now, speculation={})        # the RequestResult
    handle.emit(event, result)                                  # to iterators, result() and on_event

The driver thread (driver.py) owns every RequestState and calls these; a RequestHandle is read
from any thread (its events go through a queue; result() waits on an event). Detokenizing is
incremental (IncrementalText: a few tokens are decoded per new token, not the whole output, and a
trailing incomplete multi-byte character waits for the rest); a stop string is searched for only
where the new text could complete it, cuts the text before it and ends the request, even on the
request's last token. Each token therefore costs the same whatever the output's length.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Iterator

from treeattn.engine.request import RequestResult, SamplingParams, TokenEvent, TokenLogprob

logger = logging.getLogger(__name__)


class RequestHandle:
    """A submitted request: iterate for its TokenEvents, result() for its RequestResult.

    Args:
        request_id: the request's id.
        post: sends a message to the engine's driver (cancel() posts ("cancel", request_id)).
        on_event: called with each TokenEvent from the driver thread, or None.
        on_prefill: called as on_prefill(computed, prompt_tokens) from the driver thread after each
            step that advanced the prompt's prefill (computed counts the prompt tokens whose keys and
            values are in the cache, those found in the prefix cache included), or None.
    """

    def __init__(self, request_id: str, post: Callable[[tuple], None], on_event: Callable[[TokenEvent], None] | None,
                 on_prefill: Callable[[int, int], None] | None = None) -> None:
        self.request_id = request_id
        self._post = post
        self._on_event = on_event
        self._on_prefill = on_prefill
        self._events: queue.Queue[TokenEvent] = queue.Queue()
        self._done = threading.Event()
        self._result: RequestResult | None = None
        self.callback_error: str | None = None  # set when on_event raised a BaseException (see emit)

    def cancel(self) -> None:
        """Stop the request (its blocks are freed); it finishes with finish_reason "cancelled"."""
        self._post(("cancel", self.request_id))

    def result(self, timeout: float | None = None) -> RequestResult:
        """Wait for the request to end; TimeoutError after `timeout` seconds."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"request {self.request_id} did not finish within {timeout} s")
        return self._result

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def __iter__(self) -> Iterator[TokenEvent]:
        while True:
            event = self._events.get()
            yield event
            if event.finished:
                return

    def prefill_progress(self, computed: int, prompt_tokens: int) -> None:
        """Report prefill progress to on_prefill (driver thread only); a callback that raises is
        logged and not called again (progress is for display: it never fails the request)."""
        if self._on_prefill is None:
            return
        try:
            self._on_prefill(computed, prompt_tokens)
        except BaseException:  # noqa: BLE001 -- a display's bug must not stop the engine
            logger.exception("on_prefill callback of request %s raised; not calling it again", self.request_id)
            self._on_prefill = None

    def emit(self, event: TokenEvent, result: RequestResult | None = None) -> None:
        """Deliver `event` (and with the last one, `result`); called by the driver thread only. A
        callback that raises an Exception is logged and the request goes on; one that raises
        SystemExit, KeyboardInterrupt or another BaseException is not called again, and the driver
        fails this request alone (callback_error). Neither stops the engine."""
        if result is not None:
            self._result = result
        self._events.put(event)
        try:
            if self._on_event is not None:
                self._on_event(event)
        except Exception:  # a consumer's bug must not stop the engine
            logger.exception("on_event callback of request %s raised", self.request_id)
        except BaseException as exc:  # noqa: BLE001 -- nor may its SystemExit or KeyboardInterrupt
            logger.error("on_event callback of request %s raised %s: failing the request", self.request_id, type(exc).__name__)
            self._on_event = None
            self.callback_error = f"the on_event callback raised {type(exc).__name__}: {exc}"
        finally:
            if result is not None:
                self._done.set()


class RequestState:
    """The driver's record of one request: its handle, sequence, tokens, text and timings."""

    def __init__(self, handle: RequestHandle, prompt: list[int], params: SamplingParams, submitted: float) -> None:
        self.handle, self.prompt, self.params, self.submitted = handle, prompt, params, submitted
        self.seq = None  # the scheduler's Sequence once admitted
        self.token_ids: list[int] = []
        self.logprobs: list[TokenLogprob] = []  # one per token when params.logprobs is set
        # params.prompt_logprobs: per prompt position, its TokenLogprob (None for the first), filled in by the prefill
        self.prompt_logprobs = [None] * len(prompt) if params.prompt_logprobs is not None else None
        self.text = ""  # the text delivered so far (the events' deltas); a held-back tail is not in it
        self.first_token_at: float | None = None
        self.scheduled_at: float | None = None  # when a step first ran it (the driver sets it)
        self._detokenizer = IncrementalText()
        self._searched = 0  # stop strings cannot end before this index of the decoded text

    @property
    def request_id(self) -> str:
        return self.handle.request_id

    def add_token(self, token: int, logprob: TokenLogprob | None, tokenizer, now: float, *, last: bool) -> tuple[str, bool]:
        """Append `token`; returns (the new text to deliver, whether a stop string now ends the
        request). The text is cut right before the first occurrence of any stop string; while the
        request goes on (not `last` and no stop string), a tail that could begin a stop string is
        held back, so that delivered text is never taken back (vLLM's rule)."""
        if self.first_token_at is None:
            self.first_token_at = now
        self.token_ids.append(token)
        if logprob is not None:
            self.logprobs.append(logprob)
        text, stopped = self._text(tokenizer)
        if not (last or stopped):
            text = text[: len(text) - held_back(text, self.params.stop)]  # could begin a stop string
        delta = text[len(self.text):] if len(text) > len(self.text) else ""
        self.text += delta
        return delta, stopped

    def _text(self, tokenizer) -> tuple[str, bool]:
        """(the request's text so far, whether a stop string ended it): the decoded tokens without
        an incomplete multi-byte character at the end, cut right before the first occurrence of any
        stop string (stopped). Only the text a new token could complete a stop string in is searched."""
        if tokenizer is None:
            return "", False
        text = self._detokenizer.add(tokenizer, self.token_ids)
        stops = self.params.stop
        if not stops:
            return text, False
        start = max(0, self._searched - max(len(s) for s in stops) + 1)
        self._searched = len(text)
        cut = min((i for i in (text.find(s, start) for s in stops) if i >= 0), default=-1)
        return (text[:cut], True) if cut >= 0 else (text, False)

    def result(self, reason: str, now: float, *, error: str | None, speculation: dict) -> RequestResult:
        """The RequestResult of this request ending now with `reason`."""
        seq, first = self.seq, self.first_token_at
        return RequestResult(
            request_id=self.request_id, token_ids=list(self.token_ids), text=self.text, finish_reason=reason,
            prompt_tokens=len(self.prompt), cached_prompt_tokens=(seq.cached_prompt_tokens or 0) if seq is not None else 0,
            ttft_s=(first - self.submitted) if first is not None else float("nan"),
            decode_s=(now - first) if first is not None else 0.0, error=error, speculation=speculation,
            logprobs=list(self.logprobs) if self.params.logprobs is not None else None,
            queue_s=(self.scheduled_at - self.submitted) if self.scheduled_at is not None else float("nan"),
            prompt_logprobs=list(self.prompt_logprobs) if self.prompt_logprobs is not None else None)


def held_back(text: str, stops: tuple[str, ...]) -> int:
    """How many characters at the end of `text` could be the beginning of a stop string (the
    longest such suffix): they are delivered only once no stop string can start there."""
    held = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), held, -1):
            if text.endswith(stop[:k]):
                held = k
                break
    return held


class IncrementalText:
    """The text of a growing list of token ids, decoded a few tokens at a time (the method of
    Hugging Face's TextStreamer and vLLM's detokenizer).

    Decoding token ids one by one is wrong for byte-level vocabularies (a character's bytes may
    span tokens) and for tokenizers whose decoders look at neighbours (SentencePiece's leading
    space). Instead each call decodes ids[prefix:] and ids[prefix:read]: their difference is the
    new text, and `prefix` trails `read` by the last step's tokens so that the decoder sees their
    context. A trailing U+FFFD (an incomplete multi-byte character) is held until it completes.

        text = IncrementalText()
        for i in range(len(ids)):
            decoded = text.add(tokenizer, ids[: i + 1])   # == tokenizer.decode(ids[: i + 1]) up to a held tail
    """

    def __init__(self) -> None:
        self.text = ""
        self._prefix = 0  # ids[_prefix:_read] are already in self.text; decoded again as context
        self._read = 0

    def add(self, tokenizer, ids: list[int]) -> str:
        """The text of `ids` (the earlier call's ids and the new ones), without an incomplete tail."""
        before = tokenizer.decode(ids[self._prefix : self._read]) if self._read > self._prefix else ""
        after = tokenizer.decode(ids[self._prefix :])
        new = after[len(before):]
        if new and not new.endswith("\ufffd"):
            self.text += new
            self._prefix, self._read = self._read, len(ids)
            return self.text
        if len(ids) - self._read > 8:  # no character completes in 8 tokens: the bytes were invalid
            self.text += new.rstrip("\ufffd")
            self._prefix = self._read = len(ids)
            return self.text
        return self.text + new.rstrip("\ufffd")  # the complete characters before an incomplete one
