"""The tool contract: how a conversation carries tools, the assistant's calls and the tools' results.

One record shape, OpenAI's (the one transformers' apply_chat_template(messages, tools=...) and the chat
templates of Llama 3.1, Qwen2.5 and Qwen3 read):

    tools:    [{"type": "function", "function": {"name", "description"?, "parameters"?}}]
    assistant {"role": "assistant", "content"?, "tool_calls": [{"id"?, "type"?: "function",
               "function": {"name", "arguments"}}]}   arguments: a JSON object, or a string holding one
    tool      {"role": "tool", "content", "tool_call_id"?, "name"?}

Checked here, in one place, for every room that reads conversations (data=chat; serve may import it too):
`check_tools` and `check_calls` return the normalized forms (a call's arguments always an object, as the
templates write it with `| tojson`; an assistant message with calls and no content gets content ""), and
every problem is a GptkitError of one line naming `where`. A function's `parameters` must be a JSON Schema
of an object (checked structurally, its top level: `type` "object", `properties` an object of schema
objects, `required` a list of names among them; here the jsonschema package is not needed: serve checks
them against the meta-schema too, gptkit/serve/tool_calls.py). A `tool`
message must answer a call: it follows an assistant message with tool_calls (or another tool message of
the same answer), and its tool_call_id, when given, names one of those calls.

`Conversation` is a list of messages that carries its tools (`.tools`, None when it has none): what
gptkit.chat_templates renders with tools=.
"""

from __future__ import annotations

import json
from typing import Any

from gptkit.errors import GptkitError

# JSON Schema's type names
_SCHEMA_TYPES = ("object", "array", "string", "number", "integer", "boolean", "null")


class Conversation(list):
    """A list of messages with the tools the assistant may call (`tools`: checked, or None)."""

    tools: list[dict[str, Any]] | None = None

    def __init__(self, messages=(), tools: list[dict[str, Any]] | None = None) -> None:
        super().__init__(messages)
        self.tools = tools or None


def tools_of(messages: Any) -> list[dict[str, Any]] | None:
    """The tools a conversation carries (a Conversation's), else None."""
    return getattr(messages, "tools", None)


def check_tools(tools: Any, where: str) -> list[dict[str, Any]] | None:
    """The record's `tools`, checked (None or [] -> None); GptkitError naming `where` otherwise."""
    if tools is None or tools == []:
        return None
    if not isinstance(tools, list):
        raise GptkitError(
            f"{where}: tools must be a list of {{type: function, function: {{name, parameters}}}}"
        )
    out = []
    for i, t in enumerate(tools, 1):
        what = f"{where}: tool {i}"
        if not isinstance(t, dict) or not isinstance(t.get("function"), dict):
            raise GptkitError(f"{what} must be an object {{type: function, function: {{name, parameters}}}}")
        if t.get("type", "function") != "function":
            raise GptkitError(f"{what} has type {str(t.get('type'))[:40]!r}; only function tools are read")
        f = t["function"]
        name = f.get("name")
        if not isinstance(name, str) or not name.strip():
            raise GptkitError(f"{what} has no function name (function.name must be non-empty text)")
        if not isinstance(f.get("description", ""), str):
            raise GptkitError(f"{what} ({name}): function.description must be text")
        if "parameters" in f and f["parameters"] is not None:
            _check_schema(f["parameters"], f"{what} ({name}): function.parameters")
        out.append({**t, "type": "function"})
    return out


def _check_schema(schema: Any, what: str) -> None:
    """A function's parameters: a JSON Schema of an object, checked at its top level."""
    if not isinstance(schema, dict):
        raise GptkitError(f"{what} is not JSON Schema (a JSON object), got {type(schema).__name__}")
    if schema.get("type", "object") != "object":
        raise GptkitError(f"{what} is not a JSON Schema of an object (its type is {schema.get('type')!r})")
    props = schema.get("properties", {})
    if not isinstance(props, dict) or not all(isinstance(p, dict) for p in props.values()):
        raise GptkitError(f"{what} is not JSON Schema: properties must map each name to a schema object")
    for name, p in props.items():
        t = p.get("type")
        types = t if isinstance(t, list) else [t] if t is not None else []
        if not all(isinstance(x, str) and x in _SCHEMA_TYPES for x in types):
            raise GptkitError(
                f"{what} is not JSON Schema: property {name!r} has type {t!r} "
                f"(JSON Schema's types are {', '.join(_SCHEMA_TYPES)})"
            )
    required = schema.get("required", [])
    if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
        raise GptkitError(f"{what} is not JSON Schema: required must be a list of property names")
    missing = [r for r in required if r not in props]
    if missing:
        raise GptkitError(f"{what}: required names {', '.join(map(repr, missing))}, which properties lacks")


def check_calls(msgs: list[dict[str, Any]], where: str) -> list[dict[str, Any]]:
    """The messages with their tool calls checked and normalized (arguments an object; an assistant message
    with calls and no content gets content ""); a tool message without a call it answers, a call without a
    function name, arguments that are not a JSON object (or a string holding one): GptkitError."""
    out: list[dict[str, Any]] = []
    # the ids of the calls the tool messages being read answer (None: no call open)
    open_calls: set[str] | None = None
    for i, m in enumerate(msgs, 1):
        role = m.get("role")
        if m.get("tool_calls") == []:
            # no calls (what some clients write): as without the field, which templates test differently
            m = {k: v for k, v in m.items() if k != "tool_calls"}
        if role == "assistant" and m.get("tool_calls") is not None:
            m = {**m, "tool_calls": _calls(m["tool_calls"], f"{where}: message {i} (assistant)")}
            if m.get("content") is None:
                m["content"] = ""
            open_calls = {c["id"] for c in m["tool_calls"] if "id" in c}
        elif role == "tool":
            if open_calls is None:
                raise GptkitError(
                    f"{where}: message {i} (tool) answers no call: a tool message follows an assistant "
                    "message with tool_calls"
                )
            cid = m.get("tool_call_id")
            if cid is not None and (not isinstance(cid, str) or (open_calls and cid not in open_calls)):
                raise GptkitError(
                    f"{where}: message {i} (tool) has tool_call_id {str(cid)[:40]!r}, which names none of "
                    f"the calls before it ({', '.join(sorted(open_calls)) or 'they have no ids'})"
                )
            if "name" in m and not isinstance(m["name"], str):
                raise GptkitError(f"{where}: message {i} (tool): name must be text")
        else:
            if "tool_calls" in m:
                raise GptkitError(
                    f"{where}: message {i} ({role}) has tool_calls; only the assistant calls tools"
                )
            open_calls = None
        out.append(m)
    return out


def _calls(calls: Any, what: str) -> list[dict[str, Any]]:
    if not isinstance(calls, list) or not calls:
        raise GptkitError(f"{what}: tool_calls must be a non-empty list of {{type: function, function}}")
    out = []
    for k, c in enumerate(calls, 1):
        here = f"{what} tool call {k}"
        if not isinstance(c, dict) or not isinstance(c.get("function"), dict):
            raise GptkitError(
                f"{here} must be an object {{id?, type: function, function: {{name, arguments}}}}"
            )
        if c.get("type", "function") != "function":
            raise GptkitError(f"{here} has type {str(c.get('type'))[:40]!r}; only function calls are read")
        if "id" in c and not isinstance(c["id"], str):
            raise GptkitError(f"{here}: id must be text")
        f = c["function"]
        name = f.get("name")
        if not isinstance(name, str) or not name.strip():
            raise GptkitError(f"{here} has no function name (function.name must be non-empty text)")
        args = f.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except ValueError as exc:
                raise GptkitError(
                    f"{here} ({name}): arguments is a string that is not JSON ({exc})"
                ) from None
        if not isinstance(args, dict):
            raise GptkitError(
                f"{here} ({name}): arguments must be a JSON object (or a string holding one), "
                f"got {type(args).__name__}"
            )
        out.append({**c, "type": "function", "function": {**f, "arguments": args}})
    return out
