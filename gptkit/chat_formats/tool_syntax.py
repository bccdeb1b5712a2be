"""A template's tool-call syntax, learned from the template itself, and a reply read back into calls.

The seam: `learn(render, end)` renders a probe conversation (one tool, one assistant call) with the
template and finds how it writes a call: the text before the call's JSON object (`prefix`), the object's
keys for the name and the arguments, the text after it (`suffix`). Every family whose call is one JSON
object between fixed markers reads back the same way:

    Qwen2.5 / Qwen3 / Hermes   <tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>   (one or more)
    Llama 3.1 / 3.2            {"name": ..., "parameters": {...}}                (the whole reply, one call)

A template whose probe shows no such object (harmony's channels; a template without tool syntax): None,
and the caller says so. `CallSyntax.parse(text, tools)` reads a reply: the text before the first call is
its content, then calls only (whitespace between them); each call's name must be one of the tools and its
arguments an object valid against the tool's parameters (jsonschema). Anything else (bad JSON, an unknown
name, arguments that do not match, text after the calls) is None: the reply is text, as written.
`CallStream` holds a streamed reply's text back from where a call may start until the reply ends, so the
streamed content and calls are those `parse` reads from the whole text.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

# the probe's names: what no real conversation says
_NAME, _ARG, _VALUE = "probe_fn_\ue010", "probe_arg", "probe_value_\ue011"
_PROBE_TOOL = {
    "type": "function",
    "function": {
        "name": _NAME,
        "description": "probe",
        "parameters": {"type": "object", "properties": {_ARG: {"type": "string"}}, "required": [_ARG]},
    },
}


def _probe_call(k: int) -> dict[str, Any]:
    return {
        "id": f"call_probe{k}",
        "type": "function",
        "function": {"name": _NAME, "arguments": {_ARG: _VALUE}},
    }


@dataclass(frozen=True)
class CallSyntax:
    """How a template writes one call: prefix + {name_key: name, args_key: arguments} + suffix."""

    prefix: str
    suffix: str
    name_key: str
    args_key: str
    # the template writes several calls in one reply (Llama 3.1's refuses them)
    several: bool

    @property
    def opener(self) -> str:
        """What starts a call in a reply: the prefix's text, or the object's brace when it has none."""
        return self.prefix.strip() or "{"

    def call_text(self, name: str, arguments: dict) -> str:
        body = json.dumps({self.name_key: name, self.args_key: arguments}, ensure_ascii=False)
        return self.prefix + body + self.suffix

    def call_schema(self, tools: list[dict[str, Any]]) -> dict[str, Any]:
        """The JSON Schema of one call of any of `tools` (name first, then the arguments)."""
        options = [
            {
                "type": "object",
                "properties": {
                    self.name_key: {"const": t["function"]["name"]},
                    self.args_key: t["function"].get("parameters") or {"type": "object"},
                },
                "required": [self.name_key, self.args_key],
                "additionalProperties": False,
            }
            for t in tools
        ]
        return options[0] if len(options) == 1 else {"anyOf": options}

    def start(self, text: str) -> Optional[int]:
        """Where the first call may start in `text` (None: nowhere)."""
        if self.prefix.strip():
            i = text.find(self.opener)
            return None if i < 0 else i
        # no marker (Llama 3.1): a reply is a call only when it begins with one
        body = text.lstrip()
        return len(text) - len(body) if body.startswith("{") else None

    def held(self, text: str) -> int:
        """How much of a streamed `text` may be shown as content now: up to where a call starts, or up to
        a tail that may be the opener's beginning, never its trailing whitespace (which a call after it
        would make no part of the content)."""
        return len(text[: self._held(text)].rstrip())

    def _held(self, text: str) -> int:
        at = self.start(text)
        if at is not None:
            return at
        if not self.prefix.strip():
            # whitespace may precede a call's brace
            return 0 if not text.strip() else len(text)
        op = self.opener
        for k in range(min(len(op) - 1, len(text)), 0, -1):
            if text.endswith(op[:k]):
                return len(text) - k
        return len(text)

    def parse(
        self,
        text: str,
        tools: list[dict[str, Any]],
        *,
        only: Optional[str] = None,
        parallel: bool = True,
    ) -> Optional[tuple[Optional[str], list[dict[str, Any]]]]:
        """(content or None, [{name, arguments}]) when the reply is text then well-formed calls of the
        tools (`only`: that one's), else None (no call, or a botched one: the reply is text)."""
        at = self.start(text)
        if at is None:
            return None
        content = text[:at].rstrip() or None
        rest, calls = text[at:], []
        decoder = json.JSONDecoder()
        pre, post = self.prefix.strip(), self.suffix.strip()
        by_name = {t["function"]["name"]: t["function"] for t in tools}
        while rest.strip():
            rest = rest.lstrip()
            if not rest.startswith(pre):
                return None
            rest = rest[len(pre) :].lstrip()
            try:
                obj, end = decoder.raw_decode(rest)
            except ValueError:
                return None
            rest = rest[end:].lstrip()
            if not rest.startswith(post):
                return None
            rest = rest[len(post) :]
            if not isinstance(obj, dict) or set(obj) - {self.name_key, self.args_key}:
                return None
            name, args = obj.get(self.name_key), obj.get(self.args_key, {})
            if isinstance(args, str):
                try:
                    args = json.loads(args)
                except ValueError:
                    return None
            # a name that is not text (an object, a list) names no tool: the reply is text
            if not isinstance(name, str) or name not in by_name or (only is not None and name != only):
                return None
            if not isinstance(args, dict):
                return None
            if not arguments_valid(args, by_name[name].get("parameters")):
                return None
            calls.append({"name": name, "arguments": args})
        if not calls or (len(calls) > 1 and not (self.several and parallel)):
            return None
        return content, calls


def arguments_valid(args: dict, schema: Optional[dict]) -> bool:
    """args is valid against the tool's parameters (jsonschema)."""
    if not schema:
        return True
    import jsonschema

    return jsonschema.validators.validator_for(schema)(schema).is_valid(args)


def check_schema(schema: dict) -> Optional[str]:
    """None when `schema` is a JSON Schema (its meta-schema's check, jsonschema), else the first problem."""
    import jsonschema

    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        path = "/".join(str(p) for p in exc.path)
        return f"{exc.message[:200]}" + (f" (at {path})" if path else "")
    return None


def learn(render: Callable[..., str], end: str) -> Optional[CallSyntax]:
    """The template's call syntax from two renders (render(messages, add_generation_prompt, tools) -> text;
    end: what it writes after an assistant's turn), or None when it writes no JSON call object."""
    user = {"role": "user", "content": "probe"}

    def reply_of(n_calls: int) -> Optional[str]:
        msg = {"role": "assistant", "content": "", "tool_calls": [_probe_call(k) for k in range(n_calls)]}
        try:
            before = render([user], True, [_PROBE_TOOL])
            whole = render([user, msg], False, [_PROBE_TOOL])
        except Exception:  # noqa: BLE001 - a template may refuse the probe in any way: no syntax
            return None
        if not whole.startswith(before):
            return None
        reply = whole[len(before) :]
        return reply[: len(reply) - len(end)] if end and reply.endswith(end) else reply

    one = reply_of(1)
    if one is None:
        return None
    found = _call_object(one)
    if found is None:
        return None
    i, j, name_key, args_key = found
    syntax = CallSyntax(one[:i], one[j:], name_key, args_key, several=True)
    two = reply_of(2)
    bare = [{"type": "function", "function": {"name": _NAME}}]
    several = two is not None and two.count(_NAME) == 2 and syntax.parse(two, bare) is not None
    return CallSyntax(syntax.prefix, syntax.suffix, name_key, args_key, several=several)


def _call_object(text: str) -> Optional[tuple[int, int, str, str]]:
    """(start, end, name key, arguments key) of the probe call's JSON object in `text`."""
    decoder = json.JSONDecoder()
    for m in re.finditer(r"\{", text):
        try:
            obj, end = decoder.raw_decode(text, m.start())
        except ValueError:
            continue
        if not isinstance(obj, dict):
            continue
        name_key = next((k for k, v in obj.items() if v == _NAME), None)
        args_key = next(
            (k for k, v in obj.items() if v == {_ARG: _VALUE} or v == json.dumps({_ARG: _VALUE})), None
        )
        if name_key and args_key:
            return m.start(), end, name_key, args_key
    return None


def openai_calls(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Calls in OpenAI's shape: an id each (call_ and 24 random hex digits), arguments a JSON string."""
    return [
        {
            "id": f"call_{uuid.uuid4().hex[:24]}",
            "type": "function",
            "function": {"name": c["name"], "arguments": json.dumps(c["arguments"], ensure_ascii=False)},
        }
        for c in calls
    ]


@dataclass
class CallStream:
    """One streamed reply: feed() its text as it comes, shown content back; end() reads the whole text.
    Text from where a call may start is held until the reply ends: then it is calls (when the whole reply
    parses) or the rest of the content."""

    syntax: CallSyntax
    tools: list[dict[str, Any]]
    only: Optional[str] = None
    parallel: bool = True
    text: str = ""
    shown: int = 0
    # once a call may have started, nothing more is shown until the end
    holding: bool = field(default=False)

    def feed(self, piece: str) -> str:
        self.text += piece
        if self.holding:
            return ""
        upto = self.syntax.held(self.text)
        if self.syntax.start(self.text) is not None:
            self.holding = True
        out = self.text[self.shown : max(upto, self.shown)]
        self.shown = max(upto, self.shown)
        return out

    def end(self, cut: bool) -> tuple[str, Optional[list[dict[str, Any]]]]:
        """(the content not yet shown, the calls in OpenAI's shape or None). cut: the reply ran out of
        tokens (its calls are not whole: text)."""
        parsed = (
            None if cut else self.syntax.parse(self.text, self.tools, only=self.only, parallel=self.parallel)
        )
        if parsed is None:
            return self.text[self.shown :], None
        content, calls = parsed
        # what was shown is the start of the content parse reads
        return (content or "")[self.shown :], openai_calls(calls)
