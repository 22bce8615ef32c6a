"""Structured outputs over a real socket: `treeattn serve` (2 gloo ranks) and the official openai client.

response_format (json_object, json_schema) and vLLM's structured_outputs (json, json_object, regex,
choice, grammar) on /v1/chat/completions and /v1/completions, streamed and not; the tiny random
model of tests/gguf_files.py is forced by the mask, so every answer validates. The greedy
completion equals ta.Engine's on one in-process rank with the same constraint. A bad constraint is a
400 naming the parameter.
"""

from __future__ import annotations

import json
import re

import pytest

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")
openai = pytest.importorskip("openai")
pytest.importorskip("transformers")

from helpers.serve import NAME  # noqa: E402

import treeattn as ta  # noqa: E402
from treeattn.models import load_tokenizer  # noqa: E402
from treeattn.models.chat import encode_chat, end_of_turn_id, read_chat_template  # noqa: E402

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 6}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2}}}


@pytest.fixture(scope="module")
def model_file(tiny_llama_gguf):
    return tiny_llama_gguf  # conftest's: one file for the server tests


@pytest.fixture(scope="module")
def server(tiny_llama_server):
    """conftest's session server (2 ranks, the API key, NAME): shared with tests/test_serve.py; it stops with
    status 0 and leaves no child process at the session's end."""
    return tiny_llama_server


def _response_format(schema):
    return {"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": True}}


def test_chat_json_schema_and_json_object(server):
    client = server.client()
    for seed, temperature in ((0, 0.0), (1, 1.0), (2, 1.0)):
        answer = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "who?"}], max_tokens=120,
                                                temperature=temperature, seed=seed, response_format=_response_format(SCHEMA))
        choice = answer.choices[0]
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)
    answer = server.client().completions.create(model=NAME, prompt="a b c", max_tokens=50, temperature=0,
                                                # not a keyword of the client's completions
                                                extra_body={"response_format": {"type": "json_object"}})
    assert answer.choices[0].finish_reason == "stop"  # a random model's any-object runs long: this prompt ends it
    assert isinstance(json.loads(answer.choices[0].text), dict)


def test_completions_structured_outputs_every_kind(server):
    client = server.client()
    cases = [({"json": SCHEMA}, lambda t: jsonschema.validate(json.loads(t), SCHEMA)),
             ({"json": json.dumps(SCHEMA)}, lambda t: jsonschema.validate(json.loads(t), SCHEMA)),
             ({"regex": r"[0-9]{3}-[a-z]{2}"}, lambda t: re.fullmatch(r"[0-9]{3}-[a-z]{2}", t) or pytest.fail(t)),
             ({"choice": ["red", "green", "blue"]}, lambda t: t in ("red", "green", "blue") or pytest.fail(t)),
             ({"grammar": 'start: "x" ("+" "x"){0,3}'}, lambda t: re.fullmatch(r"x(\+x){0,3}", t) or pytest.fail(t)),
             ({"grammar": 'root ::= "ab" | "cd"'}, lambda t: t in ("ab", "cd") or pytest.fail(t))]
    for outputs, check in cases:
        for seed in (0, 1):
            answer = client.completions.create(model=NAME, prompt="the cat", max_tokens=120, temperature=1.0, seed=seed,
                                               extra_body={"structured_outputs": outputs})
            assert answer.choices[0].finish_reason == "stop", (outputs, answer.choices[0].text)
            check(answer.choices[0].text)
    answer = server.client().chat.completions.create(model=NAME, messages=[{"role": "user", "content": "pick"}], max_tokens=20,
                                                     extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert answer.choices[0].message.content in ("yes", "no")


def test_streamed_deltas_join_to_a_valid_document(server):
    stream = server.client().completions.create(model=NAME, prompt="hello", max_tokens=120, temperature=1.0, seed=5, stream=True,
                                                extra_body={"response_format": _response_format(SCHEMA)})
    chunks = list(stream)
    jsonschema.validate(json.loads("".join(c.choices[0].text for c in chunks if c.choices)), SCHEMA)
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["stop"]


def test_greedy_equals_the_engine(server, model_file):
    """A completion under a schema, and a chat under json_object (cut by max_tokens: a random model's
    any-object runs long), equal ta.Engine's tokens under the same constraint."""
    client = server.client()
    answer = client.completions.create(model=NAME, prompt="the theme", max_tokens=120, temperature=0,
                                       extra_body={"response_format": _response_format(SCHEMA)})
    messages = [{"role": "user", "content": "hi"}]
    chat = client.chat.completions.create(model=NAME, messages=messages, max_tokens=30, temperature=0,
                                          response_format={"type": "json_object"})
    tokenizer, template = load_tokenizer(model_file), read_chat_template(model_file)
    with ta.Engine(str(model_file), nproc=1, block_size=16, cache_tokens=4096, max_batch_size=8) as engine:
        ref = engine.generate(["the theme"], max_new_tokens=120, structured=ta.StructuredOutput.json(SCHEMA))[0]
        chat_ref = engine.generate([encode_chat(tokenizer, template, messages)], max_new_tokens=30, temperature=0,
                                   stop_token_ids=[end_of_turn_id(tokenizer, template)], structured=ta.StructuredOutput.json())[0]
    assert answer.choices[0].text == ref.text and ref.finish_reason == "stop"
    assert chat.choices[0].message.content == chat_ref.text and chat_ref.text.startswith("{")
    assert chat.choices[0].finish_reason == chat_ref.finish_reason


@pytest.mark.parametrize("extra, param", [
    ({"response_format": _response_format({"type": "objekt"})}, "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema.schema"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": "json"}, "response_format"),
    ({"structured_outputs": {"regex": "[0-9"}}, "structured_outputs.regex"),
    ({"structured_outputs": {"json": {"type": "string", "pattern": "[a-"}}}, "structured_outputs.json"),
    ({"structured_outputs": {"grammar": "start: foo"}}, "structured_outputs.grammar"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs.structural_tag"),
    ({"structured_outputs": {"choice": ["x" * 100] * 400}}, "structured_outputs.choice"),  # over MAX_CONSTRAINT_CHARS
    ({"structured_outputs": {"json": json.loads('{"type": "object", "properties": {"a": ' * 150 + '{}' + '}}' * 150)}},
     "structured_outputs.json"),  # nested past llguidance's recursion limit
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}}, "structured_outputs"),
])
def test_a_bad_constraint_is_a_400_naming_the_param(server, extra, param):
    http = server.http()
    for path, body in (("/v1/completions", {"prompt": "x"}), ("/v1/chat/completions",
                                                              {"messages": [{"role": "user", "content": "x"}]})):
        answer = http.post(path, json={"model": NAME, "max_tokens": 5, **body, **extra})
        assert answer.status_code == 400, answer.text
        error = answer.json()["error"]
        assert error["param"] == param and "\n" not in error["message"], error


def test_tool_calls_are_refused_naming_the_field(server):
    """The tiny model's ChatML template (as SmolLM2's and Gemma 3's) renders no tools: offering tools or
    demanding a call is a 400 naming the field; tool_choice "auto" or "none" without tools is taken."""
    client, http = server.client(), server.http()
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {}}}}
    messages = [{"role": "user", "content": "weather?"}]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=NAME, messages=messages, max_tokens=4, tools=[tool])
    assert info.value.body["param"] == "tools" and "chat template defines no tool calls" in info.value.body["message"]
    for extra, param in (({"tools": [tool], "tool_choice": "auto"}, "tools"), ({"tool_choice": "required"}, "tool_choice"),
                         ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice"),
                         ({"functions": [tool["function"]]}, "functions"), ({"function_call": {"name": "f"}}, "function_call")):
        answer = http.post("/v1/chat/completions", json={"model": NAME, "messages": messages, "max_tokens": 4, **extra})
        assert answer.status_code == 400 and answer.json()["error"]["param"] == param, (extra, answer.text)
    for choice in ("auto", "none"):
        answer = client.chat.completions.create(model=NAME, messages=messages, max_tokens=4, tool_choice=choice)
        assert answer.choices[0].message.tool_calls is None
