"""Tool calls (`tools`, `tool_choice`, the legacy `functions`, `function_call`): refused by name, saying why.

    check_tools(body, chat_template)     # APIError 400 naming the field, or None

This server does not parse tool calls. A request that offers tools (a non-empty `tools` or
`functions`) or demands a call (`tool_choice` "required" or a named function, `function_call`
other than "none"/"auto") is a 400 naming that field, whose message says whether the model's chat
template defines tools at all (SmolLM2's and Gemma 3's do not: they render no tool list, so a model
served with them was never shown one). `tool_choice` "none" or "auto" without tools changes
nothing and is taken, as OpenAI takes it.
"""

from __future__ import annotations

from treeattn.serve.protocol import bad_request

NO_OPS = (None, "none", "auto")


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


def check_tools(body, chat_template) -> None:
    """A 400 naming tools / functions / tool_choice / function_call when the request asks for tool calls."""
    extra = body.model_extra or {}
    for name in ("tools", "functions"):
        if extra.get(name) not in (None, []):
            why = ("the model's chat template takes tools, but this server does not parse tool calls"
                   if template_defines_tools(chat_template) else "the model's chat template defines no tool calls")
            raise bad_request(f"'{name}' is not supported: {why}", name)
    for name in ("tool_choice", "function_call"):
        if name in extra and extra[name] not in NO_OPS:
            raise bad_request(f"'{name}' must be \"none\" or \"auto\" here: this server makes no tool calls", name)
