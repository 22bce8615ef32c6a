"""Structured outputs: a grammar that every generated token must follow (JSON schema, regex, choice, Lark).

    constraint = StructuredOutput.json({"type": "object", "required": ["a"], ...})   # or .json() for any object,
    constraint = StructuredOutput.regex(r"[0-9]{3}"); StructuredOutput.choice(["yes", "no"])  # .grammar(lark or GBNF)
    params = SamplingParams(max_new_tokens=64, structured=constraint)                  # checked here: one line naming it
    grammars = Grammars(tokenizer, vocab_size, eos_token_ids)                          # the driver's, one per engine
    plan = grammars.mark(plan)           # each constrained chunk's SampleSpec.allowed = MASKS_AT_SAMPLING
    step_masks = grammars.masks(plan)    # StepMasks: the bitmask(s) of each marked chunk, made while the step runs
    grammars.advance(seq_id, token)      # after a token is committed

The grammar engine is llguidance (the one vLLM's "guidance" backend and llama.cpp use): chosen over
xgrammar by measurement on this CPU (benchmarks/retired/structured_mask.py, docs/data/structured_mask.txt):
its compile takes about a millisecond where xgrammar's took 60-340 ms per new schema, for a mask of
tens of microseconds per token in both. JSON is compact (no free whitespace between tokens:
whitespace_flexible False, vLLM's disable_any_whitespace), so that no model can loop on spaces.

Where it runs. The driver holds the tokenizer and every request's state; the ranks run token ids
only (they load the model without its tokenizer). So the driver keeps one llguidance matcher per
constrained sequence and consumes each committed token. A step's plan leaves with each constrained
chunk marked (SampleSpec.allowed = MASKS_AT_SAMPLING, mark()); the driver fills the chunks' bitmasks
(ceil(V / 32) int32 words: 6 KiB for SmolLM2, 32 KiB for Gemma 3; masks()) and sends them to rank 0
as their own message (StepMasks, in plan_message's words like the plan), which rank 0 reads only when
it samples, after the step's logits. Where a core is free for the driver's work (CUDA ranks, or CPU
cores beyond the ranks' threads: transport.overlap_masks) it fills them while the ranks run the
step's forward pass, as vLLM v1 does; where the ranks take every core it fills them just before the
plan leaves. Rank 0 then sets the logits of the disallowed tokens to -inf (apply_mask) before the
sampler (bias, penalties, temperature, min-p, top-k, top-p), greedy and sampled alike. The other
ranks never see a mask. Inside an existing process group (GroupChannel: the driver's thread is rank
0) the masks are filled at sampling time in the same thread. A chunk whose masks did not come fails
alone (its sampling raises). Measured costs: docs/serve.md.

End. When the grammar is complete the matcher allows only end-of-sequence: the model's eos ids and
the request's other stop tokens (a chat's end of turn), so the next token ends the request with
finish_reason "stop". ignore_eos is refused with a constraint (nothing would end it).

Speculation. Prompt-lookup drafts (speculate="ngram") get one mask per verified position: the
driver consumes the drafts in turn, fills the mask after each and rolls them back (a draft the
grammar forbids ends the run there: rank 0 cannot sample it). A draft model's drafts are made on
the ranks, after the plan: a constrained request is refused with speculate="draft".

Logprobs stay the model's own distribution, before the mask (vLLM's default logprobs_mode,
"raw_logprobs").
"""

from __future__ import annotations

import json
import logging
import threading
from dataclasses import dataclass, field, replace

import torch

logger = logging.getLogger(__name__)

KINDS = ("json", "regex", "choice", "grammar")
JSON_OPTIONS = {"whitespace_flexible": False}  # compact JSON: "," and ":" with no whitespace around them
ANY_OBJECT = {"type": "object"}


@dataclass(frozen=True)
class StructuredOutput:
    """A constraint on a request's output, checked when built (ValueError: one line naming it).

    Attributes:
        kind: "json" (value: a JSON schema as JSON text; {"type": "object"} for any object),
            "regex" (value: the pattern; the whole output matches it), "choice" (options: the
            output is one of them exactly) or "grammar" (value: a Lark grammar, or llama.cpp's GBNF).
        value: the schema, pattern or grammar text ("" for a choice).
        options: the choices (kind "choice"), else ().
        compiled: llguidance's grammar, derived (not given).

    Example::

        >>> import treeattn as ta
        >>> StructuredOutput = ta.StructuredOutput
        >>> StructuredOutput.choice(["yes", "no"]).options
        ('yes', 'no')
        >>> StructuredOutput.json({"type": "object", "properties": {"n": {"type": "integer"}}}).kind
        'json'
        >>> try:
        ...     StructuredOutput.regex("[0-9")
        ... except ValueError as error:
        ...     print(str(error)[:39])
        structured output: the regex is invalid
    """

    kind: str
    value: str = ""
    options: tuple[str, ...] = ()
    compiled: str = field(default="", compare=False, repr=False)

    def __post_init__(self) -> None:
        import llguidance

        if self.kind not in KINDS:
            raise ValueError(f"structured output: kind must be one of {', '.join(KINDS)}, got {self.kind!r:.60}")
        if self.kind == "choice":
            options = self.options
            if isinstance(options, str) or not options or not all(isinstance(o, str) and o for o in options):
                raise ValueError(f"structured output: choice must be a non-empty list of non-empty strings, got {options!r:.80}")
            object.__setattr__(self, "options", tuple(options))
        elif not isinstance(self.value, str) or not self.value:
            raise ValueError(f"structured output: the {self.kind} must be a non-empty string, got {self.value!r:.80}")
        grammar = _grammar(llguidance, self.kind, self.value, self.options)
        error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
        if error:
            first = " ".join(str(messages[0]).split()) if messages else "invalid"
            raise ValueError(f"structured output: the {self.kind if self.kind != 'json' else 'JSON schema'} is invalid: "
                             f"{first:.300}")
        object.__setattr__(self, "compiled", grammar)

    @classmethod
    def json(cls, schema: dict | str | None = None) -> "StructuredOutput":
        """Output a JSON value valid under `schema` (a dict or its JSON text); None: any JSON object."""
        if schema is None:
            schema = ANY_OBJECT
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as exc:
                raise ValueError(f"structured output: the JSON schema is not JSON: {exc}") from None
        if not isinstance(schema, dict):
            raise ValueError(f"structured output: the JSON schema must be an object, got {type(schema).__name__}")
        return cls("json", json.dumps(schema))

    @classmethod
    def regex(cls, pattern: str) -> "StructuredOutput":
        """Output text that matches `pattern` whole (Rust regex syntax, as vLLM's guidance backend)."""
        return cls("regex", pattern)

    @classmethod
    def choice(cls, options) -> "StructuredOutput":
        """Output exactly one of `options` (strings)."""
        return cls("choice", options=tuple(options) if isinstance(options, (list, tuple)) else options)

    @classmethod
    def grammar(cls, grammar: str) -> "StructuredOutput":
        """Output text of a Lark grammar (or llama.cpp's GBNF, converted)."""
        return cls("grammar", grammar)


def _grammar(llguidance, kind: str, value: str, options: tuple[str, ...]) -> str:
    """llguidance's grammar for a constraint; ValueError naming the constraint when it cannot be read."""
    try:
        if kind == "json":
            return llguidance.LLMatcher.grammar_from_json_schema(value, defaults=JSON_OPTIONS)
        if kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(value)
        if kind == "choice":
            return llguidance.grammar_from("choice", list(options))
        return llguidance.grammar_from("grammar", value)
    except ValueError as exc:
        what = "JSON schema" if kind == "json" else kind
        raise ValueError(f"structured output: the {what} is invalid: {' '.join(str(exc).split()):.300}") from None


def apply_mask(logits: torch.Tensor, allowed: bytes) -> torch.Tensor:
    """logits (1, V) with every token whose bit is clear in `allowed` (llguidance's bitmask: token t is
    bit t % 32 of int32 word t // 32) set to -inf; ValueError when no token is allowed.

        >>> import torch
        >>> from treeattn.engine.structured import apply_mask
        >>> mask = (0b1010).to_bytes(4, "little")                        # tokens 1 and 3
        >>> apply_mask(torch.zeros(1, 5), mask).tolist()
        [[-inf, 0.0, -inf, 0.0, -inf]]
    """
    vocab = logits.shape[-1]
    words = torch.frombuffer(bytearray(allowed), dtype=torch.int32)
    bits = ((words[:, None] >> torch.arange(32, dtype=torch.int32)) & 1).flatten()[:vocab].bool()
    if bits.numel() < vocab:
        bits = torch.cat((bits, bits.new_zeros(vocab - bits.numel())))
    if not bits.any():
        raise ValueError("structured output: the grammar allows no token here (its matcher failed in the driver)")
    return logits.masked_fill(~bits.to(logits.device), float("-inf"))


MASKS_AT_SAMPLING: tuple = ()  # SampleSpec.allowed of a constrained chunk whose masks come at sampling time


@dataclass(frozen=True)
class StepMasks:
    """One step's structured-output masks, the driver's message to rank 0 after the step's plan:
    seq_id -> one bitmask (llguidance's: token t is bit t % 32 of int32 word t // 32) per sampled position.

        >>> StepMasks({7: (b"\\x0f\\x00\\x00\\x00",)}).for_chunk(7)
        (b'\\x0f\\x00\\x00\\x00',)
    """

    masks: dict[int, tuple[bytes, ...]]

    def for_chunk(self, seq_id: int) -> tuple[bytes, ...]:
        """The masks of sequence `seq_id`; ValueError when the driver sent none (that request fails alone)."""
        if seq_id not in self.masks:
            raise ValueError(f"structured output: no mask came for sequence {seq_id} (its matcher failed in the driver)")
        return self.masks[seq_id]


@dataclass
class _Matcher:
    matcher: object  # llguidance.LLMatcher
    stop_ids: frozenset[int]  # the request's stop tokens: allowed wherever the grammar allows end-of-sequence


class Grammars:
    """The driver's matchers, one per constrained sequence (see the module docstring).

    Args:
        tokenizer: the model's tokenizers.Tokenizer (None: constrained requests are refused).
        vocab_size: the model's vocabulary (the logits' width; may exceed the tokenizer's).
        eos_token_ids: the model's end-of-sequence ids (what a complete grammar allows next).
        speculate: the engine's speculate setting (constraints are refused with "draft").
    """

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids, speculate: str | None = None) -> None:
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self.speculate = speculate
        self._llg_tokenizer = None  # built by prepare(): on the first constrained request, or before (serve)
        self._lock = threading.Lock()
        self._matchers: dict[int, _Matcher] = {}

    def start(self, seq_id: int, constraint, stop_ids) -> None:
        """A new sequence: its matcher, if its SamplingParams have a constraint. ValueError naming why not."""
        if constraint is None:
            return
        import llguidance

        if self.tokenizer is None:
            raise ValueError("structured outputs need the model's tokenizer; this engine has none")
        if self.speculate == "draft":
            raise ValueError("structured outputs are not supported with speculate='draft' (its drafts are made on the ranks)")
        if not self.eos_token_ids:
            raise ValueError("structured outputs need the model's end-of-sequence id (eos_token_ids is empty)")
        matcher = llguidance.LLMatcher(self.prepare(), constraint.compiled, log_level=0)
        if matcher.is_error():
            raise ValueError(f"structured output: {matcher.get_error():.300}")
        self._matchers[seq_id] = _Matcher(matcher, frozenset(stop_ids))

    def prepare(self):
        """The grammar's view of the vocabulary (llguidance.LLTokenizer), built on the first call: about
        1-2 s for SmolLM2's 49K tokens and 13-16 s for Gemma 3's 262K (under load), most of it reading
        the tokenizer's JSON, with the GIL held. Thread-safe (`treeattn serve` calls it before it listens)."""
        import llguidance

        with self._lock:
            if self._llg_tokenizer is None:
                self._llg_tokenizer = llguidance.LLTokenizer(self.tokenizer.to_str(), n_vocab=self.vocab_size,
                                                             eos_token=list(self.eos_token_ids))
            return self._llg_tokenizer

    def release(self, seq_id: int) -> None:
        self._matchers.pop(seq_id, None)

    def advance(self, seq_id: int, token: int) -> None:
        """The sequence committed `token`: its matcher consumes it (a stop token outside the grammar's
        end-of-sequence ids ends the request: nothing to consume). ValueError if the grammar refuses it."""
        state = self._matchers.get(seq_id)
        if state is None or (token in state.stop_ids and token not in self.eos_token_ids):
            return
        if not state.matcher.consume_token(token):
            raise ValueError(f"structured output: token {token} does not follow the grammar: {state.matcher.get_error():.200}")

    def mark(self, plan):
        """The plan with each constrained chunk that samples marked: SampleSpec.allowed = MASKS_AT_SAMPLING
        (its masks follow in masks(plan)'s StepMasks). Plans without one come back as they are."""
        if not self._matchers or not hasattr(plan, "chunks"):
            return plan
        marked = [replace(c, sample=replace(c.sample, allowed=MASKS_AT_SAMPLING)) if self._constrained(c) else c
                  for c in plan.chunks]
        return replace(plan, chunks=tuple(marked)) if any(m is not c for m, c in zip(marked, plan.chunks)) else plan

    def masks(self, plan) -> StepMasks | None:
        """The masks of the chunks mark() marked in `plan`: one bitmask per position each samples
        (num_draft + 1), as the grammar stands after the tokens committed so far; None when none is marked."""
        chunks = [c for c in getattr(plan, "chunks", ()) if c.sample is not None and c.sample.allowed == MASKS_AT_SAMPLING]
        if not chunks:
            return None
        masks = {}
        for chunk in chunks:
            state = self._matchers.get(chunk.seq_id)
            if state is not None:  # released since mark() (a cancel): rank 0 fails it alone, no one reads it
                masks[chunk.seq_id] = self._masks(state, chunk)
        return StepMasks(masks)

    def _constrained(self, chunk) -> bool:
        return chunk.sample is not None and chunk.seq_id in self._matchers

    def _masks(self, state: _Matcher, chunk) -> tuple[bytes, ...]:
        """The bitmask at each sampled position of `chunk`: after the drafts before it (consumed, then rolled back)."""
        drafts = chunk.tokens[len(chunk.tokens) - chunk.num_draft:] if chunk.num_draft else ()
        masks, consumed = [], 0
        for i in range(len(drafts) + 1):
            masks.append(self._mask(state))
            if i == len(drafts):
                break
            if not _allowed(masks[-1], drafts[i]) or not state.matcher.consume_token(drafts[i]):
                masks += [masks[-1]] * (len(drafts) - i)  # the run ends at i: rank 0 cannot sample the draft
                break
            consumed += 1
        if consumed:
            state.matcher.rollback(consumed)
        return tuple(masks)

    def _mask(self, state: _Matcher) -> bytes:
        """The matcher's bitmask, with the request's stop tokens allowed where end-of-sequence is."""
        mask = torch.zeros((self.vocab_size + 31) // 32, dtype=torch.int32)
        if state.matcher.is_error():
            logger.warning("structured output: the matcher failed: %s", state.matcher.get_error())
            return mask.numpy().tobytes()
        state.matcher.unsafe_compute_mask_ptr(mask.data_ptr(), mask.numel() * 4)
        raw = mask.numpy().tobytes()
        if any(_allowed(raw, eos) for eos in self.eos_token_ids):
            for token in state.stop_ids:
                if 0 <= token < self.vocab_size:
                    mask[token // 32] |= _bit(token % 32)
            raw = mask.numpy().tobytes()
        return raw


def _bit(index: int) -> int:
    """The int32 value with only bit `index` set (bit 31 is negative)."""
    return -(1 << 31) if index == 31 else 1 << index


def _allowed(mask: bytes, token: int) -> bool:
    word = token // 32
    if word * 4 + 4 > len(mask):
        return False
    return bool((int.from_bytes(mask[word * 4: word * 4 + 4], "little") >> (token % 32)) & 1)
