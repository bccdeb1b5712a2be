"""A chat request's `tools` and `tool_choice`, checked; what the reply's text is read back into.

    tools         [{"type": "function", "function": {"name", "description"?, "parameters"?}}]: checked by
                  the one tool contract (gptkit.chat_formats.tools) and each `parameters` against JSON
                  Schema's meta-schema (jsonschema); rendered into the prompt by the run's chat template
    tool_choice   "auto" (default with tools): the reply is read back into calls when it is calls;
                  "none": the tools are in the prompt, the reply is text; "required" or
                  {"type": "function", "function": {"name"}}: a grammar (xgrammar) forces one call, of
                  any tool or of that one, in the template's syntax

The template's call syntax comes from the template (ChatTemplate.call_syntax); a template that writes no
call that reads back is a 400 when a call may be read. Every problem is a 400 naming its field.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable, Optional

from gptkit.chat_formats.tool_syntax import CallStream, CallSyntax, check_schema
from gptkit.chat_formats.tools import check_tools
from gptkit.errors import GptkitError
from gptkit.serve import grammar
from gptkit.serve.protocol import bad, type_name

CHOICES = ("none", "auto", "required")


@dataclass
class ToolCalls:
    """What reads one request's replies back into calls."""

    syntax: CallSyntax
    tools: list[dict[str, Any]]
    # a named tool_choice: only that function
    only: Optional[str]
    parallel: bool

    def parse(self, text: str):
        return self.syntax.parse(text, self.tools, only=self.only, parallel=self.parallel)

    def stream(self) -> CallStream:
        return CallStream(self.syntax, self.tools, self.only, self.parallel)


@dataclass
class ToolRequest:
    # the checked tools (None: the request has none)
    tools: Optional[list[dict[str, Any]]]
    # None: the reply is text (no tools, or tool_choice none)
    calls: Optional[ToolCalls]
    # required or named: the grammar forcing a call
    constraint: Optional[Callable]


def tool_request(served, body: dict) -> ToolRequest:
    """The request's tools and tool_choice checked (a 400 naming the field otherwise)."""
    tools = _tools(body.get("tools"))
    choice = body.get("tool_choice")
    parallel = body.get("parallel_tool_calls")
    parallel = True if parallel is None else parallel
    if choice is None:
        choice = "auto"
    only = None
    if isinstance(choice, dict):
        fn = choice.get("function")
        if (
            choice.get("type") != "function"
            or set(choice) - {"type", "function"}
            or not isinstance(fn, dict)
            or not isinstance(fn.get("name"), str)
            or set(fn) - {"name"}
        ):
            raise bad(
                'tool_choice must be "none", "auto", "required" or {"type": "function", "function": '
                f'{{"name": ...}}}}, not {json.dumps(choice)[:80]}',
                "tool_choice",
                "invalid_value",
            )
        only = fn["name"]
    elif choice not in CHOICES:
        raise bad(
            f'tool_choice={json.dumps(choice)[:60]} is not one of "none", "auto", "required" or '
            '{"type": "function", "function": {"name": ...}}',
            "tool_choice",
            "invalid_value" if isinstance(choice, str) else "invalid_type",
        )
    if not tools:
        if choice in ("none", "auto"):
            return ToolRequest(None, None, None)
        raise bad(
            f"tool_choice={json.dumps(choice)[:60]} needs tools: the request has none",
            "tool_choice",
            "invalid_value",
        )
    names = [t["function"]["name"] for t in tools]
    if only is not None and only not in names:
        raise bad(
            f"tool_choice names the function {only!r}, which is not one of the tools ({', '.join(names)})",
            "tool_choice.function.name",
            "invalid_value",
        )
    if choice == "none" or served.template is None:
        # (no template: the messages' check says so)
        return ToolRequest(tools, None, None)
    syntax = served.template.call_syntax()
    if syntax is None:
        raise bad(
            f"the chat template {served.template.name} writes no tool call that gptkit can read back (no "
            'JSON call object such as {"name": ..., "arguments": ...}), so this server cannot answer with '
            'tool_calls; serve the run with a template that has tool syntax, or send tool_choice "none"',
            "tools",
            "unsupported",
        )
    calls = ToolCalls(syntax, tools, only, parallel)
    constraint = None
    if choice == "required" or only is not None:
        forced = [t for t in tools if only is None or t["function"]["name"] == only]
        constraint = grammar.tool_call(served, syntax, forced, "tools")
    return ToolRequest(tools, calls, constraint)


def _tools(tools: Any) -> Optional[list[dict[str, Any]]]:
    if tools is not None and not isinstance(tools, list):
        raise bad(f"tools must be an array, not {type_name(tools)}", "tools", "invalid_type")
    try:
        checked = check_tools(tools, "tools")
    except GptkitError as exc:
        raise bad(str(exc), "tools", "invalid_value") from None
    for i, t in enumerate(checked or []):
        f = t["function"]
        unknown = set(f) - {"name", "description", "parameters", "strict"}
        if unknown:
            where = f"tools[{i}].function.{sorted(unknown)[0]}"
            raise bad(f"{where} is not a field of a function", where, "unknown_parameter")
        if f.get("parameters") is not None:
            problem = _schema_problem(f["parameters"])
            if problem:
                where = f"tools[{i}].function.parameters"
                raise bad(f"{where} ({f['name']}) is not JSON Schema: {problem}", where, "invalid_schema")
    return checked


def _schema_problem(schema: dict) -> Optional[str]:
    try:
        return check_schema(schema)
    except ImportError:
        raise bad(
            f"tools need the jsonschema package, which this server does not have: {grammar.INSTALL}",
            "tools",
            "unsupported",
        ) from None
