"""Tool calls on /v1/chat/completions (`tools`, `tool_choice`), as vLLM's hermes tool parser makes them.

    tools = tool_request(body, chat_template)     # None, or a ToolRequest; APIError 400 naming the field
    tools.template_tools()                        # the `tools` variable the chat template renders
    tools.schema()                                # the JSON schema that "required" / a named function force
    content, calls = tools.parse(text)            # the answer's content and OpenAI tool_calls
    stream = tools.stream(); stream.feed(delta); stream.finish()   # the same, as streamed deltas

Tools are offered only to chat templates that render them (whose source reads a `tools` variable:
Qwen2.5's, Hermes', ...); on any other template a request with tools is a 400 saying the template
defines no tool calls (SmolLM2's and Gemma 3's). `tool_choice`:
- "none": the tools are rendered (as vLLM does by default) and the answer is plain content.
- "auto" (the default with tools): the model's text is parsed as vLLM's hermes parser does: every
  `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (the last one may be unclosed) is a call,
  the text before the first one is the content; text that does not parse stays content, no call.
- "required": the output is forced (llguidance, treeattn.serve.structured) to vLLM's schema, a JSON
  array of at least one {"name": <one of the tools>, "parameters": <its parameters>} (no other keys:
  stricter than vLLM's); every complete item is a call (max_tokens may cut the array: finish_reason
  "length" with the calls completed before).
- {"type": "function", "function": {"name": F}}: the output is forced to F's parameters schema and
  is F's arguments.
`parallel_tool_calls: false` keeps at most one call ("required": the array holds one item). The legacy
`functions` / `function_call` are refused by name (use tools). finish_reason is "tool_calls" when
"auto" or "required" made a call and the answer was not cut by max_tokens; a named function's
answer ends "stop", as OpenAI's does.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from treeattn.serve.protocol import _shown, bad_request

NO_OPS = (None, "none", "auto")
START, END = "<tool_call>", "</tool_call>"


def template_defines_tools(chat_template) -> bool:
    """Whether the chat template reads a `tools` variable (jinja2's undeclared variables of its source).

        >>> from treeattn.serve.tools import template_defines_tools
        >>> class Template:
        ...     template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
        >>> template_defines_tools(Template()), template_defines_tools(None)
        (False, False)
        >>> Template.template = "{% if tools %}{{ tools | tojson }}{% endif %}"
        >>> template_defines_tools(Template())
        True
    """
    source = getattr(chat_template, "template", None)
    if not isinstance(source, str):
        return False
    import jinja2
    import jinja2.meta

    try:
        return "tools" in jinja2.meta.find_undeclared_variables(jinja2.Environment().parse(source))
    except jinja2.TemplateError:
        return False


@dataclass(frozen=True)
class ToolRequest:
    """A chat request's tools, checked: `tools` the OpenAI tool objects, `choice` "none", "auto",
    "required" or "named" (then `name` is the function), `parallel` whether several calls are kept.

        >>> from treeattn.serve.tools import ToolRequest
        >>> weather = {"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}
        >>> tools = ToolRequest((weather,), "auto")
        >>> content, calls = tools.parse('Let me see.<tool_call>{"name": "weather", "arguments": {"city": "Oslo"}}</tool_call>')
        >>> content, calls[0]["function"]
        ('Let me see.', {'name': 'weather', 'arguments': '{"city": "Oslo"}'})
        >>> ToolRequest((weather,), "named", "weather").parse('{"city": "Oslo"}')[1][0]["function"]["arguments"]
        '{"city": "Oslo"}'
    """

    tools: tuple[dict, ...]
    choice: str
    name: str | None = None
    parallel: bool = True

    def template_tools(self) -> list[dict]:
        """The `tools` variable of the chat template: the tool objects as sent (OpenAI's shape)."""
        return [dict(tool) for tool in self.tools]

    def _parameters(self, function: dict) -> dict:
        return function.get("parameters") or {"type": "object", "properties": {}}

    def schema(self) -> dict | None:
        """The JSON schema the output is forced to ("required", a named function), else None (vLLM's)."""
        functions = [tool["function"] for tool in self.tools]
        if self.choice == "named":
            return self._parameters(next(f for f in functions if f["name"] == self.name))
        if self.choice != "required":
            return None
        items = [{"properties": {"name": {"type": "string", "enum": [f["name"]]}, "parameters": self._parameters(f)},
                  "required": ["name", "parameters"], "additionalProperties": False} for f in functions]
        schema = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": items}}
        return {**schema, "maxItems": 1} if not self.parallel else schema

    def parse(self, text: str) -> tuple[str | None, list[dict]]:
        """(content, tool_calls) of a whole answer; no calls: (text, [])."""
        if self.choice == "none":
            return text, []
        if self.choice == "named":
            return None, [_call(self.name, text)]
        if self.choice == "required":  # the array's complete items (all of them unless max_tokens cut it)
            deltas = ToolCallStream(self).feed(text)
            calls = [d["tool_calls"][0] for d in deltas]
            return (None, [{k: v for k, v in c.items() if k != "index"} for c in calls]) if calls else (text, [])
        return _parse_hermes(text, self.parallel)

    def stream(self) -> "ToolCallStream":
        return ToolCallStream(self)


def _call(name: str, arguments: str) -> dict:
    return {"id": f"chatcmpl-tool-{uuid.uuid4().hex}", "type": "function", "function": {"name": name, "arguments": arguments}}


def _hermes_call(body: str) -> dict | None:
    """One `<tool_call>` body as a call, None when it is not {"name": str, "arguments": ...} JSON."""
    try:
        found = json.loads(body)
    except ValueError:
        return None
    if not isinstance(found, dict) or not isinstance(found.get("name"), str):
        return None
    arguments = found.get("arguments", found.get("parameters", {}))
    return _call(found["name"], json.dumps(arguments, ensure_ascii=False))


def _parse_hermes(text: str, parallel: bool) -> tuple[str | None, list[dict]]:
    """vLLM's hermes parser: the calls of `<tool_call>...</tool_call>` (the last may be unclosed), the
    content before the first; if any call does not parse, no calls and the whole text as content."""
    first = text.find(START)
    if first < 0:
        return text, []
    calls = []
    for part in text[first:].split(START)[1:]:
        call = _hermes_call(part.split(END, 1)[0])
        if call is None:
            return text, []
        calls.append(call)
    return (text[:first] or None), calls[: None if parallel else 1]


class ToolCallStream:
    """A choice's streamed text as OpenAI chat deltas: feed(text) and finish() return a list of
    deltas ({"content": ...} or {"tool_calls": [{index, id, type, function: {name, arguments}}]}).

    "auto": content streams until `<tool_call>` (a text that could be its beginning is held back);
    each call goes out whole once its `</tool_call>` comes (or at the end); a call that does not parse
    goes out as content. "required": each array item goes out once it is complete. A named function:
    the first delta names it, then the text streams as its arguments.

        >>> from treeattn.serve.tools import ToolRequest
        >>> stream = ToolRequest(({"type": "function", "function": {"name": "f"}},), "auto").stream()
        >>> stream.feed("Hi <tool") + stream.feed('_call>{"name": "f", "arguments": {}}</tool_call>')
        [{'content': 'Hi '}, {'tool_calls': [{'index': 0, 'id': ..., 'type': 'function', 'function': {'name': 'f', 'arguments': '{}'}}]}]
    """  # noqa: E501

    def __init__(self, tools: ToolRequest) -> None:
        self.tools, self.text, self.done, self.calls = tools, "", 0, 0  # done: characters of text handled

    def feed(self, delta: str) -> list[dict]:
        self.text += delta
        if self.tools.choice == "none":
            return self._content(len(self.text))
        if self.tools.choice == "named":
            return self._named()
        if self.tools.choice == "required":
            return self._required()
        return self._auto(final=False)

    def finish(self) -> list[dict]:
        """What is still held when the choice ends (an unclosed call, a held-back prefix)."""
        if self.tools.choice == "auto":
            return self._auto(final=True)
        if self.tools.choice == "required" and self.calls == 0:  # cut short: the text as it came
            return self._content(len(self.text))
        return []

    def made_calls(self) -> bool:
        return self.calls > 0

    def _content(self, end: int) -> list[dict]:
        piece, self.done = self.text[self.done:end], max(self.done, end)
        return [{"content": piece}] if piece else []

    def _emit(self, call: dict) -> list[dict]:
        if not self.tools.parallel and self.calls >= 1:
            return []
        self.calls += 1
        return [{"tool_calls": [{"index": self.calls - 1, **call}]}]

    def _named(self) -> list[dict]:
        out = []
        if self.calls == 0:
            self.calls = 1
            out.append({"tool_calls": [{"index": 0, **_call(self.tools.name, "")}]})
        piece, self.done = self.text[self.done:], len(self.text)
        if piece:
            out.append({"tool_calls": [{"index": 0, "function": {"arguments": piece}}]})
        return out

    def _required(self) -> list[dict]:
        """Each complete item of the forced array `[{"name":..,"parameters":..},...]` as a call."""
        out, decoder = [], json.JSONDecoder()
        while True:
            at = self.done
            while at < len(self.text) and self.text[at] in "[, \n\t":
                at += 1
            try:
                item, end = decoder.raw_decode(self.text, at)
            except ValueError:
                return out
            self.done = end
            if isinstance(item, dict) and isinstance(item.get("name"), str):
                out += self._emit(_call(item["name"], json.dumps(item.get("parameters", {}), ensure_ascii=False)))

    def _auto(self, final: bool) -> list[dict]:
        out = []
        while True:
            start = self.text.find(START, self.done)
            if start < 0:
                if self.calls:  # after a call, text is not content (as the whole answer's parse)
                    self.done = len(self.text) if final else self.done
                    return out
                keep = 0 if final else _held_back(self.text[self.done:])
                return out + self._content(len(self.text) - keep)
            if self.calls == 0:
                out += self._content(start)
            end = self.text.find(END, start)
            if end < 0 and not final:
                return out
            body_end = end if end >= 0 else len(self.text)
            call = _hermes_call(self.text[start + len(START):body_end])
            if call is None:
                return out + self._content(len(self.text)) if final or end >= 0 else out
            out += self._emit(call)
            self.done = body_end + len(END) if end >= 0 else len(self.text)


def _held_back(text: str) -> int:
    """The length of the longest end of `text` that is the beginning of `<tool_call>`."""
    for k in range(min(len(START) - 1, len(text)), 0, -1):
        if START.startswith(text[-k:]):
            return k
    return 0


def tool_request(body, chat_template) -> ToolRequest | None:
    """The tool calls a chat request asks for, checked (400 naming the field); None when it offers none."""
    extra = body.model_extra or {}
    for name in ("functions", "function_call"):
        if extra.get(name) not in (None, [], "none", "auto"):
            raise bad_request(f"'{name}' (OpenAI's deprecated form) is not supported: send 'tools' and 'tool_choice'", name)
    tools, choice = extra.get("tools"), extra.get("tool_choice")
    if tools in (None, []):
        if choice not in NO_OPS:
            raise bad_request("'tool_choice' asks for a tool call, but the request offers no 'tools'", "tool_choice")
        return None
    if not template_defines_tools(chat_template):
        raise bad_request("'tools' is not supported: the model's chat template defines no tool calls", "tools")
    checked = _check_tools(tools)
    names = [tool["function"]["name"] for tool in checked]
    parallel = extra.get("parallel_tool_calls") is not False
    if choice in (None, "auto", "none", "required"):
        return ToolRequest(checked, choice or "auto", None, parallel)
    if (not isinstance(choice, dict) or choice.get("type") != "function" or not isinstance(choice.get("function"), dict)
            or not isinstance(choice["function"].get("name"), str)):
        raise bad_request('tool_choice must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}',
                          "tool_choice")
    if choice["function"]["name"] not in names:
        raise bad_request(f"tool_choice names the function '{_shown(choice['function']['name'])}', which 'tools' does not offer",
                          "tool_choice")
    return ToolRequest(checked, "named", choice["function"]["name"], parallel)


def _check_tools(tools) -> tuple[dict, ...]:
    if not isinstance(tools, list) or len(tools) > 128:
        raise bad_request("tools must be a list of at most 128 {\"type\": \"function\", \"function\": {...}} objects", "tools")
    seen = set()
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(function, dict):
            raise bad_request(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}", "tools")
        name = function.get("name")
        if not isinstance(name, str) or not name or len(name) > 64:
            raise bad_request(f"tools[{i}].function.name must be a non-empty string of at most 64 characters", "tools")
        if name in seen:
            raise bad_request(f"tools[{i}]: the function name '{name}' is offered twice", "tools")
        seen.add(name)
        parameters = function.get("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            raise bad_request(f"tools[{i}].function.parameters must be a JSON schema (an object)", "tools")
    return tuple(tools)


def check_no_tools(body) -> None:
    """/v1/completions: tools are a chat field (a 400 naming it when set to anything but its no-op)."""
    extra = body.model_extra or {}
    for name in ("tools", "functions", "tool_choice", "function_call"):
        if extra.get(name) not in (None, [], "none", "auto"):
            raise bad_request(f"'{name}' is taken only by /v1/chat/completions", name)


def template_messages(messages, chat_template) -> list[dict]:
    """A request's ChatMessages as the chat template's `messages`: role and content text, an assistant's
    tool_calls with their arguments as objects (vLLM's: Qwen2.5's and Hermes' templates write them with
    tojson), a tool message's tool_call_id and name. Tool calls in messages for a template that defines
    none are a 400 naming the message."""
    out, takes_tools = [], None
    for i, message in enumerate(messages):
        entry = {"role": message.role, "content": message.text()}
        if message.name is not None:
            entry["name"] = message.name
        if message.tool_call_id is not None:
            entry["tool_call_id"] = message.tool_call_id
        if message.tool_calls:
            takes_tools = template_defines_tools(chat_template) if takes_tools is None else takes_tools
            if not takes_tools:
                raise bad_request(f"messages[{i}].tool_calls: the model's chat template defines no tool calls", "messages")
            entry["tool_calls"] = [_template_call(call, i) for call in message.tool_calls]
        out.append(entry)
    return out


def _template_call(call, i: int) -> dict:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise bad_request(f"messages[{i}].tool_calls: each call must be {{\"type\": \"function\", \"function\": "
                          "{\"name\": ..., \"arguments\": \"<JSON>\"}}", "messages")
    arguments = function.get("arguments", "{}")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            raise bad_request(f"messages[{i}].tool_calls: function.arguments must be JSON text", "messages") from None
    return {**call, "function": {**function, "arguments": arguments}}
