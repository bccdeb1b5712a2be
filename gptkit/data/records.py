"""Records of chat-shaped data files (jsonl, json, parquet) and the conversations they hold: what data=chat
and data=preference read, every problem a one-line GptkitError naming the file and the line or row.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

from gptkit.errors import GptkitError

# pyarrow is imported where a parquet file is read.

ROLES = ("system", "user", "assistant", "tool")


def records(f: Path, fmt: str) -> Iterator[tuple[str, Any]]:
    """(where, record) for every record of a jsonl / json / parquet file; where names the file and the line
    (jsonl), record (json) or row (parquet)."""
    if fmt == "auto":
        fmt = {".jsonl": "jsonl", ".json": "json", ".parquet": "parquet"}.get(f.suffix.lower(), "")
        if not fmt:
            raise GptkitError(f"{f}: data=chat reads .jsonl, .json and .parquet files (or set data.format)")
    if fmt == "jsonl":
        with open(f, encoding="utf-8") as fh:
            for n, line in enumerate(fh, 1):
                if line.strip():
                    try:
                        yield f"{f} line {n}", json.loads(line)
                    except ValueError as exc:
                        raise GptkitError(f"{f} line {n} is not valid JSON ({exc})") from None
    elif fmt == "json":
        try:
            data = json.loads(f.read_text(encoding="utf-8"))
        except ValueError as exc:
            raise GptkitError(f"{f} is not valid JSON ({exc})") from None
        if not isinstance(data, list):
            raise GptkitError(
                f"{f}: a .json file for data=chat holds a list of records (use .jsonl for one per line)"
            )
        for n, rec in enumerate(data, 1):
            yield f"{f} record {n}", rec
    elif fmt == "parquet":
        import pyarrow.parquet as pq

        for n, rec in enumerate(pq.read_table(f).to_pylist(), 1):
            yield f"{f} row {n}", rec
    else:
        raise GptkitError(f"data.format={fmt!r} must be auto, jsonl, json or parquet")


def conversation(rec: Any, where: str, s: dict[str, Any]) -> list[dict[str, Any]]:
    """A record as a checked list of messages (role, content); GptkitError naming `where` otherwise."""
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
    return out
