"""Records of chat-shaped data files (jsonl, json, parquet) and the conversations they hold: what every
templated kind (data=chat, data=preference, data=prompts) reads, every problem a one-line GptkitError naming
the file and the line or row. `conversation`: a whole conversation (data=chat); `prompt_conversation`: the
conversation before the assistant's answer (a preference pair's, a prompt's).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Iterator

from gptkit.chat_formats.tools import Conversation, check_calls, check_tools
from gptkit.errors import GptkitError

# pyarrow is imported where a parquet file is read.

ROLES = ("system", "user", "assistant", "tool")
# how every Parquet file starts (and ends)
PARQUET_MAGIC = b"PAR1"
# a \u escape of a UTF-16 surrogate (D800-DFFF) in JSON text: a record that holds one is searched for a lone
# one (half of a pair), which decodes to a Python string no tokenizer and no UTF-8 file can take
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")
_SURROGATE = re.compile("[\ud800-\udfff]")


def records(f: Path, fmt: str) -> Iterator[tuple[str, Any]]:
    """(where, record) for every record of a jsonl / json / parquet file; where names the file and the line
    (jsonl), record (json) or row (parquet). A file that is not UTF-8, JSON nested deeper than Python can
    read, a lone surrogate escape in a string, or a Parquet file that cannot be read: a one-line GptkitError
    naming the file (and the line)."""
    if fmt == "auto":
        fmt = {".jsonl": "jsonl", ".json": "json", ".parquet": "parquet"}.get(f.suffix.lower(), "")
        if not fmt:
            raise GptkitError(f"{f}: data=chat reads .jsonl, .json and .parquet files (or set data.format)")
    if fmt in ("jsonl", "json"):
        refuse_parquet(f, fmt)
    if fmt == "jsonl":
        try:
            with open(f, encoding="utf-8") as fh:
                for n, line in enumerate(fh, 1):
                    if line.strip():
                        yield f"{f} line {n}", parsed(line, f"{f} line {n}")
        except UnicodeDecodeError:
            raise not_utf8(f) from None
    elif fmt == "json":
        try:
            text = f.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            raise not_utf8(f) from None
        data = parsed(text, str(f), check=False)
        if not isinstance(data, list):
            raise GptkitError(
                f"{f}: a .json file for data=chat holds a list of records (use .jsonl for one per line)"
            )
        check = _SURROGATE_ESCAPE.search(text) is not None
        del text
        for n, rec in enumerate(data, 1):
            if check:
                refuse_surrogates(rec, f"{f} record {n}")
            yield f"{f} record {n}", rec
    elif fmt == "parquet":
        for n, rec in enumerate(parquet_rows(f), 1):
            yield f"{f} row {n}", rec
    else:
        raise GptkitError(f"data.format={fmt!r} must be auto, jsonl, json or parquet")


def parsed(text: str, where: str, check: bool = True) -> Any:
    """The JSON value of `text` (a line, or a whole .json file), refused in one line naming `where` when it is
    not JSON, nests deeper than Python's recursion limit, or (check) holds a lone surrogate."""
    try:
        value = json.loads(text)
    except RecursionError:
        raise GptkitError(
            f"{where} is nested too deeply to read (arrays or objects inside each other beyond Python's "
            f"limit); a record is one object of messages: fix or remove it"
        ) from None
    except ValueError as exc:
        raise GptkitError(f"{where} is not valid JSON ({exc})") from None
    if check and _SURROGATE_ESCAPE.search(text):
        refuse_surrogates(value, where)
    return value


def refuse_surrogates(value: Any, where: str) -> None:
    """A GptkitError naming `where` and the field when a string of the decoded record holds a lone UTF-16
    surrogate (a \\ud800 escape without its pair). Walked with a stack: a record may nest deeply."""
    stack = [(value, "the record")]
    while stack:
        v, path = stack.pop()
        if isinstance(v, dict):
            for k, x in v.items():
                stack.append((k, f"a key of {path}"))
                stack.append((x, k if path == "the record" else f"{path}.{k}"))
        elif isinstance(v, list):
            stack.extend((x, f"{path}[{i}]") for i, x in enumerate(v))
        elif isinstance(v, str) and (m := _SURROGATE.search(v)):
            raise GptkitError(
                f"{where}: {path} holds the escape \\u{ord(m.group()):04x}, half of a UTF-16 surrogate pair "
                "without its other half, which is no character; fix the escape (a character beyond U+FFFF "
                "is a pair, e.g. \\ud83d\\ude00) or remove it"
            )


def not_utf8(f: Path) -> GptkitError:
    """The one line for a file that is not UTF-8: its first line (and byte) that does not decode."""
    with open(f, "rb") as fh:
        for n, line in enumerate(fh, 1):
            try:
                line.decode("utf-8")
            except UnicodeDecodeError as exc:
                return GptkitError(
                    f"{f} line {n} is not UTF-8 text (byte 0x{line[exc.start]:02x} at byte "
                    f"{exc.start + 1} of the line); save the file as UTF-8"
                )
    return GptkitError(f"{f} is not UTF-8 text; save the file as UTF-8")


def refuse_parquet(f: Path, fmt: str) -> None:
    """A Parquet file read as JSON (by its name, or data.format): one line saying so."""
    with open(f, "rb") as fh:
        head = fh.read(len(PARQUET_MAGIC))
    if head == PARQUET_MAGIC:
        raise GptkitError(
            f"{f} is a Parquet file, not {'JSON lines' if fmt == 'jsonl' else 'JSON'}; name it .parquet "
            "or set data.format=parquet"
        )


def parquet_rows(f: Path) -> list[dict[str, Any]]:
    """The rows of a Parquet file as dicts; a damaged, truncated or mislabelled file is one line naming it."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        return pq.read_table(f).to_pylist()
    # ArrowInvalid (a ValueError), ArrowIOError (an OSError), a string column that is not UTF-8...
    except (pa.ArrowException, OSError, ValueError) as exc:
        with open(f, "rb") as fh:
            head = fh.read(64).lstrip()
        what = (
            "it holds JSON: name it .jsonl (or .json) or set data.format=jsonl"
            if head[:1] in (b"{", b"[")
            else "it is damaged, truncated or not Parquet: write it again"
        )
        # pyarrow names the file itself
        said = str(exc).replace(f"Could not open Parquet input source '{f}': ", "").strip()
        first = said.splitlines()[0][:160] if said else type(exc).__name__
        raise GptkitError(f"{f} is not a readable Parquet file ({first}); {what}") from None


def conversation(rec: Any, where: str, s: dict[str, Any]) -> Conversation:
    """A record as a checked list of messages (role, content; an assistant's tool_calls, tool messages) with
    the record's `tools` (gptkit.chat_formats.tools); GptkitError naming `where` otherwise."""
    if not isinstance(rec, dict):
        raise GptkitError(f"{where}: a record must be a JSON object, got {type(rec).__name__}")
    mf, pf, rf, sf = s["messages_field"], s["prompt_field"], s["response_field"], s["system_field"]
    if mf in rec:
        msgs = rec[mf]
        if not isinstance(msgs, list):
            raise GptkitError(
                f"{where}: {mf} must be a list of {{role, content}} messages, got {type(msgs).__name__}"
            )
    elif pf in rec and rf in rec:
        msgs = ([{"role": "system", "content": rec[sf]}] if rec.get(sf) else []) + [
            {"role": "user", "content": rec[pf]},
            {"role": "assistant", "content": rec[rf]},
        ]
    else:
        raise GptkitError(
            f"{where}: a record needs a {mf} list or {pf} and {rf} fields "
            "(data.messages_field, data.prompt_field, data.response_field); it has "
            f"{', '.join(map(str, rec)) or 'none'}"
        )
    if not msgs:
        raise GptkitError(f"{where}: the conversation is empty")
    out = []
    for i, m in enumerate(msgs, 1):
        if isinstance(m, dict) and m.get("tool_calls") is not None and m.get("content") is None:
            # an assistant message that only calls tools (check_calls checks the role)
            m = {**m, "content": ""}
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise GptkitError(f"{where}: message {i} must be an object with role and content")
        if m["role"] not in ROLES:
            raise GptkitError(
                f"{where}: message {i} has the unknown role {m['role']!r}; roles are {', '.join(ROLES)}"
            )
        if not isinstance(m["content"], str):
            raise GptkitError(
                f"{where}: message {i} ({m['role']}) has content of type "
                f"{type(m['content']).__name__}; content must be text"
            )
        out.append({k: v for k, v in m.items() if v is not None})
    if not any(m["role"] == "assistant" for m in out):
        raise GptkitError(
            f"{where}: the conversation has no assistant turn, so nothing in it would be learned"
        )
    # the tools the assistant may call, its calls and the tools' results (gptkit.chat_formats.tools)
    return Conversation(check_calls(out, where), check_tools(rec.get("tools"), where))


def prompt_conversation(
    rec: Any, where: str, s: dict[str, Any], ends: str, record: str, tail: str | None = None
) -> list[dict[str, Any]]:
    """The conversation before the assistant's answer that a record holds (a messages list that does not end
    with the assistant, or a prompt (+ system)), checked as data=chat checks a conversation; GptkitError
    naming `where` otherwise. ends: why a messages list may not end with the assistant; record: what the
    record is called ("a prompt record"); tail: what the error of a record with neither field ends with
    (None: the fields it has)."""
    if not isinstance(rec, dict):
        raise GptkitError(f"{where}: a record must be a JSON object, got {type(rec).__name__}")
    mf, pf, sf = s["messages_field"], s["prompt_field"], s["system_field"]
    if mf in rec:
        msgs = rec[mf]
        last = msgs[-1] if isinstance(msgs, list) and msgs else None
        if isinstance(last, dict) and last.get("role") == "assistant":
            raise GptkitError(f"{where}: {mf} ends with an assistant turn; {ends}")
    elif pf in rec:
        if not isinstance(rec[pf], str) or not rec[pf].strip():
            raise GptkitError(f"{where}: {pf} must be non-empty text")
        msgs = ([{"role": "system", "content": rec[sf]}] if rec.get(sf) else []) + [
            {"role": "user", "content": rec[pf]}
        ]
    else:
        tail = f"; it has {', '.join(map(str, rec)) or 'none'}" if tail is None else tail
        raise GptkitError(
            f"{where}: {record} needs a {mf} list or a {pf} (data.messages_field, data.prompt_field){tail}"
        )
    # data=chat's reading of a messages list (it asks for an assistant turn: one is added, then dropped)
    as_chat = {**s, "response_field": None}
    if not isinstance(msgs, list) or not msgs:
        conversation({mf: msgs}, where, as_chat)
    tools = rec.get("tools")
    conv = conversation({mf: [*msgs, {"role": "assistant", "content": "-"}], "tools": tools}, where, as_chat)
    return Conversation(conv[:-1], conv.tools)
