"""The structured-output fields of a request body, as a StructuredOutput (treeattn.engine.structured).

    constraint = structured_output(body, engine)   # None, or a StructuredOutput; APIError 400 naming the field

OpenAI's `response_format` on both endpoints:
    {"type": "text"}                                                   no constraint
    {"type": "json_object"}                                            any JSON object
    {"type": "json_schema", "json_schema": {"name": "...", "schema": {...}, "strict": true}}
vLLM's `structured_outputs` object (exactly one of its kinds):
    {"json": {...} or "..."}, {"json_object": true}, {"regex": "..."}, {"choice": ["a", "b"]}, {"grammar": "..."}
    (grammar: Lark, or llama.cpp's GBNF); "disable_any_whitespace" is taken (JSON is always compact
    here), other keys (structural_tag, whitespace_pattern, backend, ...) are refused by name.
The same constraint twice costs one check: constraints are kept by their text (an LRU of 256).
A constraint's text (the schema's JSON, the regex, the grammar, the choices' JSON) is at most
MAX_CONSTRAINT_CHARS: checking and compiling one takes time in proportion (a 76,000-character schema
of 2,000 properties: 0.16 s to check, then 0.2 s to build its matcher in the engine's driver, which
every running request waits for; measured under load).
"""

from __future__ import annotations

import functools
import json

from treeattn.engine.structured import StructuredOutput
from treeattn.serve.protocol import bad_request

MAX_CONSTRAINT_CHARS = 1 << 15
KINDS = ("json", "json_object", "regex", "choice", "grammar")
IGNORED = ("disable_any_whitespace", "disable_fallback", "disable_additional_properties")


def structured_output(body, engine, tools=None) -> StructuredOutput | None:
    """The constraint `body` asks for (its response_format or structured_outputs, or the schema its
    tool_choice forces: tools, a treeattn.serve.tools.ToolRequest), checked; None when none."""
    extra = body.model_extra or {}
    response_format, outputs = extra.get("response_format"), extra.get("structured_outputs")
    plain = response_format is None or (isinstance(response_format, dict) and response_format.get("type") == "text")
    if response_format is not None and outputs is not None and not plain:
        raise bad_request("set response_format or structured_outputs, not both", "structured_outputs")
    tool_schema = tools.schema() if tools is not None else None
    if tool_schema is not None:
        if outputs is not None or not plain:
            raise bad_request("tool_choice \"required\" or a named function forces the output: it cannot be combined with "
                              "response_format or structured_outputs", "tool_choice")
        kind, value, param = "json", tool_schema, "tools"
    elif outputs is not None:
        kind, value, param = _from_structured_outputs(outputs)
    elif response_format is not None:
        found = _from_response_format(response_format)
        if found is None:
            return None
        kind, value, param = found
    else:
        return None
    if engine.tokenizer is None:
        raise bad_request("structured outputs need the model's tokenizer; this model has none", param)
    if getattr(engine.config, "speculate", None) == "draft":
        raise bad_request("structured outputs are not supported with --speculate draft", param)
    text = json.dumps(value) if kind in ("json", "choice") else value
    if len(text) > MAX_CONSTRAINT_CHARS:
        raise bad_request(f"{param}: the constraint has {len(text)} characters; this server takes at most {MAX_CONSTRAINT_CHARS}",
                          param)
    try:
        # not sort_keys: the order of a schema's properties is the order they are generated in
        return _cached(kind, text)
    except ValueError as exc:
        message = str(exc).removeprefix("structured output: ")
        raise bad_request(f"{param}: {message}", param) from None


@functools.lru_cache(maxsize=256)
def _cached(kind: str, text: str) -> StructuredOutput:
    if kind == "json":
        return StructuredOutput.json(json.loads(text))
    if kind == "choice":
        return StructuredOutput.choice(json.loads(text))
    return StructuredOutput(kind, text)


def _from_response_format(fmt) -> tuple[str, object, str] | None:
    if not isinstance(fmt, dict) or not isinstance(fmt.get("type"), str):
        raise bad_request("response_format must be an object with a \"type\": text, json_object or json_schema",
                          "response_format")
    kind = fmt["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return "json", {"type": "object"}, "response_format"
    if kind != "json_schema":
        raise bad_request(f"response_format.type must be text, json_object or json_schema, got {kind!r:.60}",
                          "response_format.type")
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict):
        raise bad_request("response_format.json_schema must be an object with name and schema", "response_format.json_schema")
    name = spec.get("name")
    if name is not None and not isinstance(name, str):
        raise bad_request("response_format.json_schema.name must be a string", "response_format.json_schema.name")
    schema = spec.get("schema")
    if not isinstance(schema, (dict, bool)):
        raise bad_request("response_format.json_schema.schema must be a JSON schema (an object)",
                          "response_format.json_schema.schema")
    if schema is True or schema is False:
        raise bad_request("response_format.json_schema.schema must be an object, got a boolean",
                          "response_format.json_schema.schema")
    return "json", schema, "response_format.json_schema.schema"


def _from_structured_outputs(outputs) -> tuple[str, object, str]:
    if not isinstance(outputs, dict):
        raise bad_request("structured_outputs must be an object with one of json, json_object, regex, choice, grammar",
                          "structured_outputs")
    unknown = next((k for k in outputs if k not in KINDS and k not in IGNORED), None)
    if unknown is not None:
        raise bad_request(f"structured_outputs.{unknown:.60} is not supported (supported: {', '.join(KINDS)})",
                          f"structured_outputs.{unknown:.60}")
    given = [k for k in KINDS if outputs.get(k) not in (None, False)]
    if len(given) != 1:
        raise bad_request(f"structured_outputs must set exactly one of {', '.join(KINDS)}, got {len(given)}",
                          "structured_outputs")
    kind = given[0]
    value, param = outputs[kind], f"structured_outputs.{kind}"
    if kind == "json_object":
        if value is not True:
            raise bad_request("structured_outputs.json_object must be true", param)
        return "json", {"type": "object"}, param
    if kind == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError:
                raise bad_request("structured_outputs.json: the JSON schema is not JSON", param) from None
        if not isinstance(value, dict):
            raise bad_request("structured_outputs.json must be a JSON schema (an object or its JSON text)", param)
        return "json", value, param
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(v, str) and v for v in value):
            raise bad_request("structured_outputs.choice must be a non-empty list of non-empty strings", param)
        return "choice", value, param
    if not isinstance(value, str) or not value:
        raise bad_request(f"structured_outputs.{kind} must be a non-empty string", param)
    return kind, value, param

