"""response_format, and a forced tool call: structured output through a grammar engine (xgrammar, in the
`serve` extra).

    {"type": "text"} or none           no constraint
    {"type": "json_object"}            any JSON object (the schema {"type": "object"}, not strict)
    {"type": "json_schema",            JSON valid against the schema (xgrammar's JSON Schema compiler; strict
     "json_schema": {"schema", ...}}   true or absent: no property the schema does not name)

A request's grammar is compiled when it is checked (a schema the engine cannot compile is a 400 naming
response_format); each choice then gets a matcher (a batcher Constraint): before every token the matcher's
bitmask sets the logits of the tokens it forbids to -inf in that sequence's row alone, and the token sampled
advances it (tokens holding a raw control character are forbidden too: xgrammar's JSON strings let them
through, JSON parsers do not). The grammar lets the reply's end-of-turn token through only where the JSON
is complete, so a reply that ends by itself (finish_reason "stop") parses; one cut by max_tokens
("length") may not.

tool_choice "required" or a named function (gptkit/serve/tool_calls.py): `tool_call` compiles one call in
the template's syntax (its markers, then the call's JSON: the name, then arguments valid against the
tool's parameters), so a reply that ends by itself always reads back as a call.

The compiler reads the model's vocabulary as bytes (gptkit.serve.tokens.TokenTexts) once, at the first
request that asks for a format; it caches what it compiles.
"""

from __future__ import annotations

import json
import re
from typing import Any, Callable, Optional

import torch

from gptkit.serve.protocol import ApiError, bad, type_name

INSTALL = 'pip install -e ".[serve]"'
_ENGINE_PREFIX = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*")


class _Matcher:
    """One choice's constraint (gptkit.inference.batcher.Constraint) over an xgrammar matcher."""

    def __init__(self, xgr, compiled, stop_ids: list[int], control: torch.Tensor) -> None:
        self.xgr = xgr
        self.matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=stop_ids or None)
        self.bitmask = xgr.allocate_token_bitmask(1, len(control))
        self.control = control

    def mask(self, logits: torch.Tensor) -> None:
        self.matcher.fill_next_token_bitmask(self.bitmask)
        self.xgr.apply_token_bitmask_inplace(logits.unsqueeze(0), self.bitmask.to(logits.device))
        if self.control.device != logits.device:
            self.control = self.control.to(logits.device)
        logits.masked_fill_(self.control, float("-inf"))

    def advance(self, token: int) -> None:
        if not self.matcher.accept_token(token):
            raise RuntimeError(f"the grammar refused token {token}")

    @property
    def done(self) -> bool:
        return self.matcher.is_terminated()


class Grammars:
    """xgrammar's compiler over one served model's vocabulary."""

    def __init__(self, xgr, vocabulary: list[bytes], stop_ids: list[int]) -> None:
        self.xgr = xgr
        self.vocab_size = len(vocabulary)
        self.stop_ids = stop_ids
        info = xgr.TokenizerInfo(
            vocabulary, vocab_type=xgr.VocabType.RAW, vocab_size=self.vocab_size, stop_token_ids=stop_ids
        )
        self.compiler = xgr.GrammarCompiler(info, max_threads=1)
        # tokens holding a control character (U+0000-U+001F): compact JSON has none (a string escapes them),
        # but xgrammar's string rule lets most of them through raw, which JSON parsers refuse
        self.control = torch.tensor([any(b < 0x20 for b in piece) for piece in vocabulary])

    def constraint(self, compiled) -> Callable[[], _Matcher]:
        return lambda: _Matcher(self.xgr, compiled, self.stop_ids, self.control)


def _grammars(served, field: str = "response_format") -> Grammars:
    if served.grammar is None:
        try:
            import xgrammar as xgr
        except ImportError:
            raise bad(
                f"{field} needs the grammar engine xgrammar, which this server does not have: " + INSTALL,
                field,
                "unsupported",
            ) from None
        served.grammar = Grammars(xgr, served.tokens.vocabulary(), list(served.chat_stop))
    return served.grammar


def response_format(served, rf: Any) -> Optional[Callable]:
    """The constraint factory a request's response_format asks for (None: plain text), or a 400."""
    if rf is None:
        return None
    if not isinstance(rf, dict):
        raise bad(
            f"response_format must be an object, not {type_name(rf)}", "response_format", "invalid_type"
        )
    kind = rf.get("type")
    known = {"text": {"type"}, "json_object": {"type"}, "json_schema": {"type", "json_schema"}}
    if kind not in known:
        raise bad(
            f"response_format.type={json.dumps(kind)[:40]} is not one of text, json_object, json_schema",
            "response_format.type",
            "invalid_value",
        )
    extra = next((k for k in rf if k not in known[kind]), None)
    if extra is not None:
        raise bad(f"response_format.{extra} is not a field of a {kind} format", f"response_format.{extra}")
    if kind == "text":
        return None
    if kind == "json_object":
        return _compile(served, {"type": "object"}, False, "response_format")
    spec = rf.get("json_schema")
    where = "response_format.json_schema"
    if not isinstance(spec, dict):
        raise bad(f"{where} must be an object with a schema", where, "invalid_type")
    extra = next((k for k in spec if k not in ("name", "description", "schema", "strict")), None)
    if extra is not None:
        raise bad(f"{where}.{extra} is not a field of json_schema", f"{where}.{extra}", "unknown_parameter")
    schema, strict = spec.get("schema"), spec.get("strict")
    if not isinstance(schema, dict):
        raise bad(f"{where}.schema must be a JSON Schema object", f"{where}.schema", "invalid_type")
    if strict is not None and not isinstance(strict, bool):
        raise bad(f"{where}.strict must be a boolean", f"{where}.strict", "invalid_type")
    return _compile(served, schema, strict is not False, f"{where}.schema")


def tool_call(served, syntax, tools: list[dict[str, Any]], where: str) -> Callable:
    """tool_choice required or a named function: a grammar forcing one call of one of `tools` in the
    template's syntax (gptkit.chat_formats.tool_syntax.CallSyntax: its markers without their outer
    whitespace, which the reader skips; the call's JSON as the template writes it, `, ` and `: ` between
    its parts, its arguments valid against the tool's parameters); a 400 naming `where` when the engine
    cannot compile a tool's parameters."""
    g = _grammars(served, where)
    xgr = g.xgr
    try:
        parts = [
            xgr.Grammar.from_json_schema(
                json.dumps(syntax.call_schema(tools)), any_whitespace=False, separators=(", ", ": ")
            )
        ]
        pre, post = syntax.prefix.strip(), syntax.suffix.strip()
        if pre:
            parts.insert(0, xgr.Grammar.from_ebnf("root ::= " + json.dumps(pre)))
        if post:
            parts.append(xgr.Grammar.from_ebnf("root ::= " + json.dumps(post)))
        compiled = g.compiler.compile_grammar(xgr.Grammar.concat(*parts) if len(parts) > 1 else parts[0])
    except Exception as exc:  # noqa: BLE001 - whatever the engine refuses is the request's fault
        raise ApiError(
            400, f"the grammar engine cannot compile {where}: {_engine_line(exc)}", where, "invalid_schema"
        ) from None
    return g.constraint(compiled)


def _engine_line(exc: BaseException) -> str:
    # "[09:52:49] /project/cpp/json_schema_converter.cc:5082: Unsupported type "foo"": the last part
    return _ENGINE_PREFIX.sub("", (str(exc).strip().splitlines() or [""])[0])[:300]


def _compile(served, schema: dict, strict: bool, where: str) -> Callable:
    """The schema compiled (JSON without optional whitespace), or a 400 naming `where`."""
    g = _grammars(served, where.split(".")[0])
    try:
        compiled = g.compiler.compile_json_schema(
            json.dumps(schema), any_whitespace=False, strict_mode=strict
        )
    except Exception as exc:  # noqa: BLE001 - whatever the engine refuses is the request's fault
        raise ApiError(
            400, f"the grammar engine cannot compile {where}: {_engine_line(exc)}", where, "invalid_schema"
        ) from None
    return g.constraint(compiled)
