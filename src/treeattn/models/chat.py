"""Chat templates: render chat messages to the token ids an instruct model expects.

    template = read_chat_template("model.gguf")       # or an HF directory; None if it has none
    ids = encode_chat(tokenizer, template, [{"role": "user", "content": "Hi"}])
    stop = end_of_turn_id(tokenizer, template)         # e.g. <|im_end|>, <|eot_id|>

The template is the model's own jinja2 source: `chat_template` of tokenizer_config.json or the file
chat_template.jinja in a Hugging Face directory, metadata tokenizer.chat_template in a GGUF. It is
rendered as transformers renders it (a sandboxed jinja2 environment, trim_blocks and lstrip_blocks,
raise_exception and strftime_now available, bos_token / eos_token as variables) with
add_generation_prompt=True, so the text ends where the assistant's answer begins. The rendered text
already holds every special token the model wants (BOS included, where the template writes it),
so it is encoded without adding special tokens.

Rendering is bounded, since a template is a program the model file brings: at most
TEMPLATE_MAX_STEPS steps (each iteration of range(), each call, attribute or item access, each
intercepted operator), TEMPLATE_MAX_SECONDS of wall-clock time (checked at those steps) and
TEMPLATE_MAX_CHARS characters of output; `"x" * n` and `a ** b` are refused when their result would
be too big. Every failure, a bound or anything the template raises (TemplateError, RecursionError,
TypeError, ...), is one ChatTemplateError (a ValueError) naming the template.

The end-of-turn token is read off the template itself: render an assistant turn around a marker
and take the first token after the marker (ChatML's <|im_end|>, Llama 3's <|eot_id|>, Mistral's
</s>). Generation stops there as well as at the model's eos ids.
"""

from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import dataclass
from datetime import datetime
from functools import cached_property
from pathlib import Path

TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
GGUF_TEMPLATE_KEY = "tokenizer.chat_template"
_MARKER = "\x00treeattn-end-of-turn-probe\x00"
TEMPLATE_MAX_STEPS = 1_000_000  # range() iterations, calls, attribute/item reads and operators of one rendering
TEMPLATE_MAX_SECONDS = 5.0  # wall-clock time of one rendering (checked at every step)
TEMPLATE_MAX_CHARS = 1 << 22  # characters one rendering may produce


class ChatTemplateError(ValueError):
    """A chat template failed (did not compile, raised, or went past a bound).

    Attributes:
        template_name: the template's name without directories ("model.gguf:tokenizer.chat_template",
            "tokenizer_config.json"), what a server may show its clients.
        reason: what went wrong, without the template's path.
    """

    def __init__(self, source: str, reason: str) -> None:
        super().__init__(f"{source}: {reason}")
        self.template_name = os.path.basename(source)
        self.reason = reason


class _Budget(threading.local):
    """The steps and deadline of the rendering running on this thread (None: not rendering)."""

    steps: int = 0
    deadline: float | None = None


_budget = _Budget()


def _step() -> None:
    """Count one step of the current rendering; raise once it is over its step or time budget."""
    _budget.steps += 1
    if _budget.steps > TEMPLATE_MAX_STEPS:
        raise _TemplateLimit(f"it took more than {TEMPLATE_MAX_STEPS} steps (loop iterations, calls, reads)")
    if _budget.deadline is not None and _budget.steps % 1024 == 0 and time.monotonic() > _budget.deadline:
        raise _TemplateLimit(f"it ran for more than {TEMPLATE_MAX_SECONDS:g} s")


class _TemplateLimit(Exception):
    """A rendering went past a bound."""


def _bounded_range(*args):
    for value in range(*args):
        _step()
        yield value


def _bounded_environment():
    """A sandboxed jinja2 environment (transformers' settings) whose renderings count their steps."""
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class BoundedEnvironment(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset({"*", "**", "+"})

        def call(self, context, obj, *args, **kwargs):
            _step()
            return super().call(context, obj, *args, **kwargs)

        def getattr(self, obj, attribute):
            _step()
            return super().getattr(obj, attribute)

        def getitem(self, obj, argument):
            _step()
            return super().getitem(obj, argument)

        def call_binop(self, context, operator, left, right):
            _step()
            if operator == "*":
                for seq, times in ((left, right), (right, left)):
                    if isinstance(seq, (str, list, tuple)) and isinstance(times, int) and len(seq) * times > TEMPLATE_MAX_CHARS:
                        raise _TemplateLimit(f"a repetition would hold more than {TEMPLATE_MAX_CHARS} items")
            if operator == "**" and isinstance(left, int) and isinstance(right, int) and abs(left) > 1 and right > 256:
                raise _TemplateLimit(f"{left} ** {right} is too big a power")
            return super().call_binop(context, operator, left, right)

    env = BoundedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.globals["range"] = _bounded_range
    return env


@dataclass(frozen=True)
class ChatTemplate:
    """A model's chat template.

    Attributes:
        source: where it came from ("dir/tokenizer_config.json", "file.gguf:tokenizer.chat_template"),
            named in errors.
        template: the jinja2 source.
        bos_token, eos_token: the texts of the model's BOS / EOS tokens (template variables).
    """

    source: str
    template: str
    bos_token: str | None = None
    eos_token: str | None = None

    @cached_property
    def _compiled(self):
        env = _bounded_environment()
        env.filters["tojson"] = lambda value, indent=None, **_: json.dumps(value, ensure_ascii=False, indent=indent)
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            return env.from_string(self.template)
        except Exception as exc:  # noqa: BLE001 -- TemplateSyntaxError, RecursionError on deep nesting, ...
            raise ChatTemplateError(self.source, f"the chat template does not compile: {_describe(exc)}") from None

    def render(self, messages: list[dict], *, add_generation_prompt: bool = True, variables: dict | None = None) -> str:
        """The prompt text of `messages` ([{"role": ..., "content": ...}, ...]), within the bounds of
        the module docstring (TEMPLATE_MAX_STEPS, TEMPLATE_MAX_SECONDS, TEMPLATE_MAX_CHARS).
        variables: more template variables (a request's chat_template_kwargs, e.g. enable_thinking);
        they cannot replace messages, add_generation_prompt, bos_token or eos_token.

        Raises:
            ValueError: bad messages; ChatTemplateError (a ValueError) when the template fails.
        """
        check_messages(messages)
        compiled = self._compiled
        _budget.steps, _budget.deadline = 0, time.monotonic() + TEMPLATE_MAX_SECONDS
        parts, size = [], 0
        try:
            for part in compiled.generate({**(variables or {}), "messages": messages,
                                           "add_generation_prompt": add_generation_prompt,
                                           "bos_token": self.bos_token or "", "eos_token": self.eos_token or ""}):
                _step()
                size += len(part)
                if size > TEMPLATE_MAX_CHARS:
                    raise _TemplateLimit(f"its output is longer than {TEMPLATE_MAX_CHARS} characters")
                parts.append(part)
        except Exception as exc:  # noqa: BLE001 -- whatever the template raises is this template's failure
            raise ChatTemplateError(self.source, f"the chat template failed on these messages: {_describe(exc)}") from None
        finally:
            _budget.deadline = None
        return "".join(parts)


def _describe(exc: BaseException) -> str:
    """One line for a template's failure: the message (jinja2's own, or a bound's), else the type and message."""
    from jinja2 import TemplateError

    if isinstance(exc, (TemplateError, _TemplateLimit)):
        return str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}".rstrip(": ")


def _raise(message: str):
    from jinja2 import TemplateError

    raise TemplateError(message)


def read_chat_template(model: str | os.PathLike) -> ChatTemplate | None:
    """The chat template of an HF directory or a .gguf file, None if it has none."""
    from treeattn.models.gguf import is_gguf

    return _gguf_template(Path(model)) if is_gguf(model) else _directory_template(Path(model))


def gguf_chat_template(reader, path) -> ChatTemplate | None:
    """The chat template of an open GGUF reader (see treeattn.models.gguf.open_gguf), or None."""
    from treeattn.models.gguf import metadata
    from treeattn.models.gguf_tokenizer import special_token

    template = metadata(reader, GGUF_TEMPLATE_KEY, None)
    if not template:
        return None
    return ChatTemplate(f"{path}:{GGUF_TEMPLATE_KEY}", template, special_token(reader, "bos_token_id"),
                        special_token(reader, "eos_token_id"))


def _gguf_template(path: Path) -> ChatTemplate | None:
    from treeattn.models.gguf import open_gguf

    return gguf_chat_template(open_gguf(path), path)


def _directory_template(model_dir: Path) -> ChatTemplate | None:
    config_path = model_dir / TOKENIZER_CONFIG_FILE
    config = {}
    if config_path.exists():
        try:
            config = json.loads(config_path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ValueError(f"{config_path}: not valid JSON: {exc}") from exc
    bos, eos = _token_text(config.get("bos_token")), _token_text(config.get("eos_token"))
    jinja_path = model_dir / CHAT_TEMPLATE_FILE
    if jinja_path.exists():
        return ChatTemplate(str(jinja_path), jinja_path.read_text(encoding="utf-8"), bos, eos)
    template = config.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if not template:
        return None
    if not isinstance(template, str):
        raise ValueError(f"{config_path}: 'chat_template' must be a string, got {type(template).__name__}")
    return ChatTemplate(str(config_path), template, bos, eos)


def _token_text(value) -> str | None:
    """tokenizer_config.json spells a special token as a string or as {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def check_messages(messages) -> None:
    """Raise ValueError unless `messages` is a non-empty list of {"role": str, "content": str}."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError(f"chat messages must be a non-empty list of {{'role', 'content'}} dicts, got {messages!r:.80}")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"),
                                                           str) or not isinstance(message.get("content"), str):
            raise ValueError(f"chat message {i} must be a dict with string 'role' and 'content', got {message!r:.80}")


def is_chat(prompts) -> bool:
    """Whether `prompts` is one conversation (a list of message dicts) or a batch of them."""
    if not isinstance(prompts, (list, tuple)) or not prompts:
        return False
    first = prompts[0]
    return isinstance(first, dict) or (isinstance(first, (list, tuple)) and bool(first) and isinstance(first[0], dict))


def messages(prompt: str, system: str | None = None) -> list[dict]:
    """One user turn, after an optional system turn."""
    turns = [{"role": "system", "content": system}] if system is not None else []
    return turns + [{"role": "user", "content": prompt}]


def encode_chat(tokenizer, template: ChatTemplate, conversation: list[dict]) -> list[int]:
    """Token ids of the rendered conversation with the generation prompt (no special tokens added:
    the template writes them)."""
    return tokenizer.encode(template.render(conversation), add_special_tokens=False).ids


def chat_end_of_turn(files, where: str, *, otherwise: str = "") -> int | None:
    """end_of_turn_id of a model's files (models.loader.ModelFiles) that can chat: a tokenizer and a
    chat template, else one ValueError "<where> has no tokenizer (...)" / "... no chat template (...)"
    naming the files each can come from, with `otherwise` (what to do instead) appended to the latter."""
    if files.tokenizer is None:
        raise ValueError(f"{where} has no tokenizer (tokenizer.json, or tokenizer.ggml.* metadata in a .gguf)")
    if files.chat_template is None:
        raise ValueError(f"{where} has no chat template (tokenizer_config.json 'chat_template', "
                         f"chat_template.jinja, or tokenizer.chat_template in a .gguf){otherwise}")
    return end_of_turn_id(files.tokenizer, files.chat_template)

def end_of_turn_id(tokenizer, template: ChatTemplate) -> int | None:
    """The token that closes an assistant turn in this template, None if none can be found."""
    probe = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": _MARKER}]
    try:
        text = template.render(probe, add_generation_prompt=False)
    except ValueError:
        return None
    if _MARKER not in text:
        return None
    after = text.split(_MARKER, 1)[1].lstrip(" ")
    ids = tokenizer.encode(after, add_special_tokens=False).ids if after else []
    if not ids:
        return None
    special = {token.content for token in tokenizer.get_added_tokens_decoder().values() if token.special}
    return ids[0] if tokenizer.id_to_token(ids[0]) in special else None


def encode_prompts(model, prompts) -> tuple[list[list[int]], list[int]]:
    """Chat prompts -> (token ids of each, stop ids to add: the end-of-turn token).

    `prompts` is one conversation or a batch of them; `model` carries .tokenizer and .chat_template
    (set by treeattn.load_model). Raises ValueError naming what is missing.
    """
    tokenizer, template = getattr(model, "tokenizer", None), getattr(model, "chat_template", None)
    if tokenizer is None or template is None:
        missing = "tokenizer" if tokenizer is None else "chat template"
        raise ValueError(f"prompts are chat messages, but the model has no {missing} "
                         "(load it with treeattn.load_model from a directory or .gguf that has one)")
    batch = [prompts] if isinstance(prompts[0], dict) else list(prompts)
    ids = [encode_chat(tokenizer, template, conversation) for conversation in batch]
    eot = end_of_turn_id(tokenizer, template)
    return ids, ([eot] if eot is not None else [])


__all__ = [
    "ChatTemplate",
    "ChatTemplateError",
    "check_messages",
    "encode_chat",
    "encode_prompts",
    "end_of_turn_id",
    "gguf_chat_template",
    "is_chat",
    "messages",
    "read_chat_template",
]
