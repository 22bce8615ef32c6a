"""Tool calls over a real socket: `treeattn serve` on a tiny random model carrying Qwen2.5's chat template
(which renders `tools` and writes calls in the hermes format), and the official openai client.

tool_choice "required" and a named function are forced by the structured-output mask, so even the
random model's calls always parse and their arguments validate against the tool's schema, greedy
and sampled, streamed and not. "auto" parses the hermes `<tool_call>` format (vLLM's hermes parser):
the random model is forced to write one by a regex constraint, so the parse is tested on real output.
The tools are rendered into the prompt by the template (the prompt's token count is the offline
render's). The parser itself is checked offline: streaming any split of a text gives the same calls
and content as parsing it whole.
"""

from __future__ import annotations

import doctest
import json
import time

import pytest

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")
openai = pytest.importorskip("openai")
pytest.importorskip("transformers")

from gguf_files import QWEN25_TOOLS  # noqa: E402
from helpers.serve import KEY, NAME, Server, _alive, _write_tiny_llama_gguf  # noqa: E402

from treeattn.models import load_tokenizer  # noqa: E402
from treeattn.models.chat import read_chat_template  # noqa: E402
from treeattn.serve import tools as tools_module  # noqa: E402
from treeattn.serve.tools import ToolRequest  # noqa: E402

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "the weather in a city",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "days"],
                   "properties": {"city": {"type": "string", "maxLength": 8}, "days": {"type": "integer", "minimum": 1,
                                                                                       "maximum": 7}}}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "additionalProperties": False, "required": ["zone"], "properties": {"zone": {"enum": ["UTC", "CET"]}}}}}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
MESSAGES = [{"role": "user", "content": "weather?"}]


@pytest.fixture(scope="module")
def model_file(tmp_path_factory):
    return _write_tiny_llama_gguf(tmp_path_factory.mktemp("serve_tools") / f"{NAME}.gguf", 0, chat_template=QWEN25_TOOLS,
                                  context_length=4096, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2)


@pytest.fixture(scope="module")
def server(model_file):
    srv = Server(model_file, "--nproc", "2", "--api-key", KEY, "--served-model-name", NAME)
    yield srv
    assert srv.stop() == 0
    time.sleep(0.5)
    assert _alive(srv.children) == []


def _validate(call) -> None:
    assert call.type == "function" and call.id.startswith("chatcmpl-tool-")
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def _streamed(client, **kwargs):
    """(content, [(id, name, arguments)], finish_reason) accumulated from the deltas, as a client does."""
    content, calls, reason = "", {}, None
    for chunk in client.chat.completions.create(model=NAME, messages=MESSAGES, stream=True, **kwargs):
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for delta in choice.delta.tool_calls or ():
            entry = calls.setdefault(delta.index, ["", "", ""])
            entry[0] += delta.id or ""
            entry[1] += (delta.function.name or "") if delta.function else ""
            entry[2] += (delta.function.arguments or "") if delta.function else ""
        reason = choice.finish_reason or reason
    return content, [tuple(calls[i]) for i in sorted(calls)], reason


def test_tools_are_rendered_by_the_template(server, model_file):
    """The prompt is the template's render with `tools` (and an earlier call and its answer in the history)."""
    tokenizer, template = load_tokenizer(model_file), read_chat_template(model_file)
    history = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Oslo", "days": 1}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "rain"}]
    answer = server.client().chat.completions.create(model=NAME, messages=history, tools=TOOLS, tool_choice="none",
                                                     max_tokens=2, temperature=0)
    rendered = template.render([MESSAGES[0], {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function",
                                "function": {"name": "get_weather", "arguments": {"city": "Oslo", "days": 1}}}]},
                                {"role": "tool", "tool_call_id": "c1", "content": "rain"}], variables={"tools": TOOLS})
    assert '"name": "get_weather"' in rendered and '{"city": "Oslo", "days": 1}' in rendered and "<tools>" in rendered
    assert answer.usage.prompt_tokens == len(tokenizer.encode(rendered, add_special_tokens=False).ids)
    assert answer.choices[0].message.tool_calls is None  # "none": plain content


@pytest.mark.parametrize("seed, temperature", [(0, 0.0), (1, 1.0), (2, 1.0)])
def test_required_always_makes_valid_calls(server, seed, temperature):
    """parallel_tool_calls false: the forced array holds one call, so the answer ends; streamed, the same call."""
    client = server.client()
    kwargs = dict(tools=TOOLS, tool_choice="required", parallel_tool_calls=False, max_tokens=120, temperature=temperature,
                  seed=seed)
    choice = client.chat.completions.create(model=NAME, messages=MESSAGES, **kwargs).choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1, choice.message
    _validate(choice.message.tool_calls[0])
    content, calls, reason = _streamed(client, **kwargs)
    assert reason == "tool_calls" and content == ""
    assert [(n, a) for _, n, a in calls] == [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]


def test_required_parallel_calls_are_each_valid(server):
    """Several calls: each complete item is a valid call, also when max_tokens cuts the array (finish_reason length)."""
    choice = server.client().chat.completions.create(model=NAME, messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                                     max_tokens=60, temperature=0).choices[0]
    assert choice.finish_reason in ("tool_calls", "length") and choice.message.tool_calls, choice.message
    for call in choice.message.tool_calls:
        _validate(call)


@pytest.mark.parametrize("name", ["get_weather", "get_time"])
def test_a_named_function_is_called_with_valid_arguments(server, name):
    client = server.client()
    choice_param = {"type": "function", "function": {"name": name}}
    for seed, temperature in ((0, 0.0), (5, 1.0)):
        answer = client.chat.completions.create(model=NAME, messages=MESSAGES, tools=TOOLS, tool_choice=choice_param,
                                                max_tokens=120, temperature=temperature, seed=seed)
        choice = answer.choices[0]
        assert choice.finish_reason == "stop" and len(choice.message.tool_calls) == 1  # as OpenAI answers a named call
        assert choice.message.tool_calls[0].function.name == name
        _validate(choice.message.tool_calls[0])
        content, calls, reason = _streamed(client, tools=TOOLS, tool_choice=choice_param, max_tokens=120,
                                           temperature=temperature, seed=seed)
        assert calls == [(calls[0][0], name, choice.message.tool_calls[0].function.arguments)] and reason == "stop"


HERMES = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>'


def test_auto_parses_the_hermes_format(server):
    """The random model, forced by a regex to write some text then a hermes call, gets it parsed into tool_calls."""
    client = server.client()
    regex = "(Let me check\\. )?" + HERMES.replace("{", "\\{").replace("}", "\\}").replace(".", "\\.")
    extra = {"structured_outputs": {"regex": regex}}
    answer = client.chat.completions.create(model=NAME, messages=MESSAGES, tools=TOOLS, max_tokens=120, temperature=0,
                                            extra_body=extra)
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls", choice.message
    assert [(c.function.name,
             json.loads(c.function.arguments)) for c in choice.message.tool_calls] == [("get_time", {"zone": "CET"})]
    content, calls, reason = _streamed(client, tools=TOOLS, tool_choice="auto", max_tokens=120, temperature=0, extra_body=extra)
    assert (content or None) == choice.message.content and reason == "tool_calls"
    assert [(n, json.loads(a)) for _, n, a in calls] == [("get_time", {"zone": "CET"})]


def test_auto_without_a_call_is_plain_content(server):
    answer = server.client().chat.completions.create(model=NAME, messages=MESSAGES, tools=TOOLS, max_tokens=20, temperature=0,
                                                     extra_body={"structured_outputs": {"regex": "sunny <tool"}})
    choice = answer.choices[0]
    assert choice.message.content == "sunny <tool" and choice.message.tool_calls is None and choice.finish_reason == "stop"


@pytest.mark.parametrize("extra, param, words", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "does not offer"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", "tool_choice must be"),
    ({"tools": [{"type": "function", "function": {}}]}, "tools", "function.name"),
    ({"tools": [WEATHER, WEATHER]}, "tools", "offered twice"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice",
     "cannot be combined"),
    ({"functions": [WEATHER["function"]]}, "functions", "deprecated"),
    ({"tool_choice": "required"}, "tool_choice", "offers no 'tools'"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}], "tool_choice": "required"},
     "tools", ""),
])
def test_bad_tool_requests_are_400_naming_the_field(server, extra, param, words):
    response = server.http().post("/v1/chat/completions", json={"model": NAME, "messages": MESSAGES, "max_tokens": 2, **extra})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and words in error["message"], error


def test_tools_on_completions_are_400(server):
    response = server.http().post("/v1/completions", json={"model": NAME, "prompt": "hi", "max_tokens": 2, "tools": TOOLS})
    assert response.status_code == 400 and response.json()["error"]["param"] == "tools"


# ------------------------------------------------------------------------- the parser, offline


def test_tools_module_examples_run():
    assert doctest.testmod(tools_module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE).failed == 0


TEXTS = [
    "just text, no call",
    "Sure. " + HERMES,
    HERMES + "\n" + HERMES.replace("CET", "UTC"),
    'x <tool_call>{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}',  # unclosed: still a call
    "a <tool_call>not json</tool_call>",  # does not parse: all content
    "ends with <tool_ca",
]


def _via_stream(tools: ToolRequest, text: str, cuts: list[int]):
    stream, deltas, at = tools.stream(), [], 0
    for cut in cuts + [len(text)]:
        deltas += stream.feed(text[at:cut])
        at = cut
    deltas += stream.finish()
    content = "".join(d.get("content", "") for d in deltas)
    calls = {}
    for d in deltas:
        for call in d.get("tool_calls", ()):
            entry = calls.setdefault(call["index"], ["", ""])
            entry[0] += call.get("function", {}).get("name", "")
            entry[1] += call.get("function", {}).get("arguments", "")
    return content, [tuple(calls[i]) for i in sorted(calls)]


@pytest.mark.parametrize("text", TEXTS)
def test_streaming_any_split_gives_the_whole_parse(text):
    tools = ToolRequest(tuple(TOOLS), "auto")
    content, calls = tools.parse(text)
    whole = ((content or ""), [(c["function"]["name"], c["function"]["arguments"]) for c in calls])
    if text == TEXTS[4]:  # a call that does not parse: content (the stream could not take back an emitted call; here none)
        assert whole == (text, [])
    for i in range(len(text) + 1):
        for j in range(i, len(text) + 1, 7):
            assert _via_stream(tools, text, [i, j]) == whole, (i, j)


def test_required_stream_matches_its_parse():
    tools = ToolRequest(tuple(TOOLS), "required")
    text = '[{"name":"get_weather","parameters":{"city":"Oslo","days":2}},{"name":"get_time","parameters":{"zone":"UTC"}}]'
    content, calls = tools.parse(text)
    assert content is None
    for i in range(len(text) + 1):
        assert _via_stream(tools, text, [i]) == ("", [(c["function"]["name"], c["function"]["arguments"]) for c in calls])
