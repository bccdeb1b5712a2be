"""Where a training row came from, read from the prepared data (`gptkit trace`): nothing is trained.

A token-shard folder built since issue 39 keeps, beside each shard, a documents file (`train.docs`): one
DOC_ROW per document, in the shard's order: where the document's tokens end, its source (an index into the
manifest's `documents.sources`: a file, a pydoc topic, a hub dataset), its number among that source's
documents and the byte offset of its record in the file (JSON lines; text files: 0; -1 where the build could
not tell). A window of the train shard then resolves to the documents it overlaps (a binary search over the
ends), and each to a place in its source:

    text file      byte 1,234                                  (the file is one document)
    JSON lines     line 57 (byte 9,876), byte 12 of its text    (the line counted on demand)
    other records  text 3 of the file, byte 12 of its text      (json arrays, parquet: the 3rd non-empty text)
    hub dataset    document 1,235 of the stream, byte 12 of its text
    pydoc topic    byte 12 of its text

Byte offsets inside a document are exact for byte-level and per-character tokenizers (each token's UTF-8
bytes summed) and decoded for any other. data=tokens keeps no documents: a window resolves to its token
files and the token (and byte) offset in each ("offsets only"). A folder prepared before documents were
recorded resolves to token positions only.
"""

from __future__ import annotations

import bisect
import json
import re
from pathlib import Path
from typing import Any

import numpy as np

from gptkit.data.face import Origin, Span
from gptkit.fsio import file_crc32
from gptkit.tokenizer import bytes_to_unicode

# beside a shard (train.docs for train.bin): one row per document of its tokens, in order: the position just
# after its last token (its EOS included), its source (an index into the manifest's documents.sources: a file,
# a topic, a dataset; -1: not known), its number among that source's documents, and its byte offset in that
# source (-1: not known). For a split by fraction train.docs covers the validation tokens too (after the
# train split's). Written by builds since `gptkit trace` (issue 39); a folder without them still trains.
DOCS_SUFFIX = ".docs"
DOC_ROW = np.dtype([("end", "<i8"), ("source", "<i4"), ("record", "<i8"), ("offset", "<i8")])
# a document longer than this many tokens is not decoded to find a byte offset inside it (tokenizers that are
# neither byte-level nor per character)
DECODE_LIMIT = 1 << 20
# control characters shown escaped in a row's text
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_ESCAPES = {"\n": "\\n", "\t": "\\t", "\r": "\\r"}


def show(text: str, chars: int) -> str:
    """The first `chars` characters of a text on one line: newlines, tabs and other control characters
    escaped, an ellipsis where it was cut."""
    cut = text[:chars]
    out = _CONTROL.sub(lambda m: _ESCAPES.get(m.group(), f"\\x{ord(m.group()):02x}"), cut)
    return out + ("…" if len(text) > chars else "")


def byte_lengths(tokenizer) -> np.ndarray | None:
    """[vocab] the UTF-8 bytes of each token's text, for a byte-level BPE (GPT-2 style, gptkit's byte and bpe)
    or a per-character tokenizer (gptkit's char); added (special) tokens count 0: they are markup, not text.
    None for any other tokenizer (its bytes are found by decoding)."""
    spec = json.loads(tokenizer.to_str())
    model, decoder = spec.get("model") or {}, spec.get("decoder") or {}
    vocab = model.get("vocab")
    if not isinstance(vocab, dict):
        return None
    lengths = np.zeros(tokenizer.get_vocab_size(with_added_tokens=True), dtype=np.int64)
    if decoder.get("type") == "ByteLevel":
        chars = {c: b for b, c in bytes_to_unicode().items()}
        if not all(ch in chars for token in vocab for ch in token):
            return None
        for token, i in vocab.items():
            lengths[i] = len(token)
    elif model.get("type") == "WordLevel" and all(len(t) == 1 for t in vocab):
        for token, i in vocab.items():
            lengths[i] = len(token.encode("utf-8"))
    else:
        return None
    for t in spec.get("added_tokens") or []:
        if t.get("special"):
            lengths[t["id"]] = 0
    return lengths


class TextBytes:
    """Bytes of text of token id sequences (what a document's first tokens were in its source)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.lengths = byte_lengths(tokenizer)

    def count(self, ids: np.ndarray) -> int | None:
        """The UTF-8 bytes of the text of `ids` (None: too long to decode)."""
        if self.lengths is not None:
            return int(self.lengths[np.asarray(ids, dtype=np.int64)].sum())
        if len(ids) > DECODE_LIMIT:
            return None
        return len(self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=True).encode("utf-8"))

    def text(self, ids: np.ndarray) -> str:
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)


def jsonl_offset(path: str, text_field: str, k: int) -> int | None:
    """The byte offset of the line of the k-th record with a non-empty text (0-based) of a JSON-lines file,
    read line by line (for documents a build did not record the offset of); None: none such now."""
    try:
        with open(path, "rb") as f:
            at = 0
            for line in f:
                if line.strip():
                    try:
                        record = json.loads(line)
                    except ValueError:
                        return None
                    if isinstance(record, dict) and record.get(text_field):
                        if k == 0:
                            return at
                        k -= 1
                at += len(line)
    except OSError:
        return None
    return None


def line_of(path: str, offset: int, known: tuple[int, int] = (0, 1)) -> int | None:
    """The 1-based line of a file at byte `offset` (None: the file is gone or shorter now); known: a byte
    offset <= offset and its line, where counting starts."""
    p = Path(path)
    at, line = known
    try:
        if p.stat().st_size < offset:
            return None
        n = line - 1
        with open(p, "rb") as f:
            f.seek(at)
            left = offset - at
            while left > 0:
                block = f.read(min(left, 8 << 20))
                if not block:
                    return None
                n += block.count(b"\n")
                left -= len(block)
        return n + 1
    except OSError:
        return None


class ShardOrigins:
    """Where the windows of one token-shard folder's train split came from (see the module docstring)."""

    def __init__(self, folder: Path, manifest: dict[str, Any], tokens: np.ndarray, tokenizer) -> None:
        self.folder, self.manifest, self.tokens = Path(folder), manifest, tokens
        self.bytes = TextBytes(tokenizer)
        self.docs, self.sources, self.note = self._documents()
        self.formats = self._formats()
        # per JSON-lines file, the last (byte offset, line) found
        self._lines: dict[str, tuple[int, int]] = {}
        source = manifest.get("source") or {}
        self.text_field = str((source.get("settings") or {}).get("text_field", "text"))
        # data=tokens: each file's tokens, the train split's first
        self.token_files = None
        if source.get("kind") == "tokens" and source.get("tokens"):
            counts = [int(n) for n in source["tokens"]]
            self.token_files = (source["files"], np.cumsum([0, *counts]), source)

    def _documents(self) -> tuple[np.ndarray | None, list[str], str]:
        """(the train split's documents, their sources' names, why there are none)."""
        record = (self.manifest.get("documents") or {}).get("train")
        if record is None:
            if (self.manifest.get("source") or {}).get("kind") == "tokens":
                return None, [], "token files keep no documents"
            return None, [], "documents not recorded: prepared before gptkit recorded them"
        f = self.folder / record["file"]
        if not f.is_file() or file_crc32(f) != record["crc32"]:
            return None, [], f"{f} is missing or damaged (its CRC-32 differs from the manifest's)"
        rows = np.fromfile(f, dtype=DOC_ROW)
        return rows, list(self.manifest["documents"]["sources"]), ""

    def _formats(self) -> dict[str, str]:
        """{source: its format (text, json, parquet)} for local files (data=files, data=stdlib)."""
        source = self.manifest.get("source") or {}
        kind, settings = source.get("kind"), source.get("settings") or {}
        if kind == "stdlib":
            return {name: "text" for name in self.sources}
        if kind != "files":
            return {}
        fmt = settings.get("format", "auto")
        out = {}
        for name in self.sources:
            suffix = Path(name).suffix.lower()
            auto = {".json": "json", ".jsonl": "json", ".parquet": "parquet"}.get(suffix, "text")
            out[name] = auto if fmt == "auto" else fmt
        return out

    def origin(self, row: int, part: str | None, start: int, seq_len: int, chars: int) -> Origin:
        """The Origin of the window of seq_len input tokens at `start` of the train shard."""
        end = start + seq_len
        text = show(self.bytes.text(self.tokens[start : min(end, start + 4 * chars + 8)]), chars)
        if self.docs is not None:
            spans = self._document_spans(start, end)
        elif self.token_files is not None:
            spans = self._file_spans(start, end)
        else:
            spans = [Span(None, None, f"token {start:,} ({self.note})", seq_len)]
        return Origin(row, part, f"token {start:,}", spans, text)

    def _document_spans(self, start: int, end: int) -> list[Span]:
        ends = self.docs["end"]
        k = int(np.searchsorted(ends, start, side="right"))
        spans = []
        while k < len(ends):
            doc_start = int(ends[k - 1]) if k else 0
            if doc_start >= end:
                break
            a, b = max(start, doc_start), min(end, int(ends[k]))
            spans.append(self._span(k, doc_start, a, b - a))
            k += 1
        return spans

    def _span(self, k: int, doc_start: int, a: int, n: int) -> Span:
        """Document k's share of a window: n tokens from position a (the document starts at doc_start)."""
        inner = 0 if a == doc_start else self.bytes.count(self.tokens[doc_start:a])
        inside = f"token {a - doc_start:,} of its text" if inner is None else f"byte {inner:,} of its text"
        return Span(k, self.source_of(k), self.where(k, inner, inside, a > doc_start), n)

    def where(self, k: int, inner: int | None, inside: str, within: bool) -> str:
        """Where in its source document k is, and a place `inner` bytes into its text (`inside` in words;
        within: that place is not the document's start)."""
        row, name = self.docs[k], self.source_of(k)
        fmt = self.formats.get(name) if name is not None else None
        offset, record = int(row["offset"]), int(row["record"])
        # a JSON-lines file read in batches of pieces (mixed with other formats): its line looked up now
        if fmt == "json" and offset < 0 and Path(name).suffix.lower() == ".jsonl":
            offset = jsonl_offset(name, self.text_field, record)
            offset = -1 if offset is None else offset
        if fmt == "text":
            where = f"byte {inner:,}" if inner is not None else inside
        elif fmt == "json" and offset >= 0:
            # counted on from the last line found in that file when it lies before (a scan asks in order)
            known = self._lines.get(name, (0, 1))
            line = line_of(name, offset, known if known[0] <= offset else (0, 1))
            if line is not None:
                self._lines[name] = (offset, line)
            place = f"line {line:,} (byte {offset:,})" if line is not None else f"byte {offset:,}"
            where = place + (f", {inside}" if within else "")
        elif fmt is not None:
            where = f"text {record + 1:,} of the file" + (f", {inside}" if within else "")
        elif name is not None and name.startswith("hub dataset"):
            where = f"document {record + 1:,} of the stream" + (f", {inside}" if within else "")
        else:
            where = inside if within else ""
        return where

    def source_of(self, k: int) -> str | None:
        """The name of document k's source (a file, a topic, a data set; None: not known)."""
        src = int(self.docs[k]["source"])
        return self.sources[src] if 0 <= src < len(self.sources) else None

    def _file_spans(self, start: int, end: int) -> list[Span]:
        """data=tokens: the token files a window lies in, and its token (and byte) offset in each."""
        files, bounds, source = self.token_files
        spans = []
        i = bisect.bisect_right(list(bounds), start) - 1
        while i < len(files) and bounds[i] < end:
            a, b = max(start, int(bounds[i])), min(end, int(bounds[i + 1]))
            if b > a:
                t = a - int(bounds[i])
                header = int((source.get("header_bytes") or [0] * len(files))[i])
                size = np.dtype((source.get("dtypes") or ["uint16"] * len(files))[i]).itemsize
                spans.append(Span(None, files[i], f"token {t:,} (byte {header + t * size:,})", b - a))
            i += 1
        return spans
