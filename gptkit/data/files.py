"""Local data files as bounded pieces of text: which files a config names, how each is read and decoded, and
JSON-lines files cut into byte ranges that tokenization workers read themselves.

Text files must be UTF-8. `encoding_errors: strict` (the default for files) stops at the first
undecodable byte and names the file and byte offset; `replace` substitutes U+FFFD and goes on (also
for JSON lines; a .json file holding one JSON array must be valid UTF-8 either way). FIFOs, devices
and sockets are refused before anything is read. Nothing here holds a whole file: text is read and
decoded READ_BYTES at a time, JSON lines one line at a time, parquet RECORDS records at a time.
"""

from __future__ import annotations

import codecs
import glob
import hashlib
import json
import os
import stat
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

from gptkit.errors import GptkitError

# pyarrow is imported where a parquet file is read.

# a bounded piece of a document's text, and whether it is the document's last piece
Part = tuple[str, bool]
# a callable that starts a fresh pass over the corpus, piece by piece
Parts = Callable[[], Iterator[Part]]

FORMATS = ("auto", "text", "json", "parquet")


# a text file is read (and decoded) this many bytes at a time
READ_BYTES = 1 << 20


# json/parquet records read at a time
RECORDS = 1000


def files_digest(files: list[Path]) -> str:
    h = hashlib.sha256()
    for f in files:
        try:
            with open(f, "rb") as fh:
                h.update(hashlib.file_digest(fh, "sha256").digest())
        except OSError as exc:
            raise unreadable_file(f, exc) from None
    return h.hexdigest()


def spelled_in(files: list[Path], strings: list[str], formats: list[str]) -> bool:
    """Whether the text of the files may spell one of `strings` (special tokens): a string's UTF-8 bytes in a
    file; in a JSON file (format json) also a \\u escape (or \\/) of one of its characters, which may
    spell it; a parquet file (compressed) always may. Reads each file once, READ_BYTES at a time."""
    strings = sorted({t for t in strings if t})
    if not strings:
        return False
    raw = [t.encode() for t in strings]
    chars = sorted({c for t in strings for c in t})
    # lower case, as the blocks are compared (JSON's hex digits have either case)
    escapes = [b"\\u%04x" % u for c in chars for u in _utf16(c)] + ([b"\\/"] if "/" in chars else [])
    for f, fmt in zip(files, formats):
        if fmt == "parquet":
            return True
        keep = max(len(x) for x in raw + escapes) - 1
        tail = b""
        try:
            with open(f, "rb") as fh:
                for block in iter(lambda: fh.read(READ_BYTES), b""):
                    buf = tail + block
                    if any(x in buf for x in raw):
                        return True
                    if fmt == "json" and b"\\" in buf and any(e in buf.lower() for e in escapes):
                        return True
                    tail = buf[-keep:] if keep else b""
        except OSError as exc:
            raise unreadable_file(f, exc) from None
    return False


def _utf16(c: str) -> list[int]:
    """The UTF-16 code units of a character (a JSON \\u escape names one)."""
    b = c.encode("utf-16-be")
    return [int.from_bytes(b[i : i + 2], "big") for i in range(0, len(b), 2)]


def unreadable_file(f: Path | str, exc: OSError) -> GptkitError:
    """One line for a data file that cannot be opened or read (permissions, a failing disk, special files)."""
    why = exc.strerror or " ".join(str(exc).split())[:120]
    return GptkitError(f"{f}: cannot read it ({why}); check the file and the disk it lies on")


# ---- local files -----------------------------------------------------------------------------------
def check_regular(p: Path, what: str) -> None:
    """A FIFO, a device or a socket would block or never end: refused before anything is read."""
    mode = os.stat(p).st_mode
    if not stat.S_ISREG(mode):
        kind = (
            "a FIFO (named pipe)"
            if stat.S_ISFIFO(mode)
            else "a character device"
            if stat.S_ISCHR(mode)
            else "a block device"
            if stat.S_ISBLK(mode)
            else "a socket"
            if stat.S_ISSOCK(mode)
            else "not a regular file"
        )
        raise GptkitError(f"{what}: {p} is {kind}; give regular files (copy a stream to a file first)")


def expand_paths(patterns: Any, what: str, *, quiet: bool = False) -> list[Path]:
    """Paths and globs -> existing regular files, in the given order (each glob sorted). Each file is taken
    once, by its resolved path, where it first appears: a file that a glob finds again (through a symbolic
    link, or a link loop such as sub/up -> .. that `**` follows again and again), that two globs both match,
    or that is listed twice, is skipped after its first place, and one note on stderr says how many paths
    were (not with `quiet`: a check before the build that says it). (Listing a file twice does not weight
    it twice: data=mix weights sources.)"""
    if patterns is None or isinstance(patterns, str):
        patterns = [] if patterns is None else [patterns]
    out: list[Path] = []
    for pat in patterns:
        pat = os.path.expanduser(str(pat))
        if glob.has_magic(pat):
            found = sorted(p for p in glob.glob(pat, recursive=True) if not os.path.isdir(p))
            if not found:
                raise GptkitError(f"{what}: the glob {pat!r} matches no files; check the path")
            for f in found:
                check_regular(Path(f), what)
            out += [Path(p).resolve() for p in found]
            continue
        p = Path(pat)
        if not p.exists():
            raise GptkitError(
                f"{what}: {p} does not exist; give existing files, e.g. data.paths=[corpus.txt]"
            )
        if p.is_dir():
            raise GptkitError(f"{what}: {p} is a folder; give files or a glob such as '{p}/**/*.txt'")
        check_regular(p, what)
        out.append(p.resolve())
    unique = list(dict.fromkeys(out))
    if len(unique) < len(out) and not quiet:
        n = len(out) - len(unique)
        print(
            f"note: {what}: skipped {n:,} {'path' if n == 1 else 'paths'} to files already listed (the "
            f"same file by its resolved path: a symbolic link, a link loop or a path given twice); each file "
            f"is read once",
            file=sys.stderr,
        )
    return unique


def file_format(p: Path, fmt: str) -> str:
    """The format of a data file: data.format when given, else from its suffix (json, parquet, text)."""
    if fmt not in FORMATS:
        raise GptkitError(f"data.format={fmt!r} is not one of {', '.join(FORMATS)}")
    if fmt != "auto":
        return fmt
    suffix = p.suffix.lower()
    return {".json": "json", ".jsonl": "json", ".parquet": "parquet"}.get(suffix, "text")


def _bad_byte(path: Path, offset: int, byte: bytes) -> GptkitError:
    return GptkitError(
        f"{path}: byte {offset} ({byte!r}) is not valid UTF-8; fix the file or set "
        f"data.encoding_errors=replace to substitute U+FFFD"
    )


def check_errors(errors: str) -> None:
    if errors not in ("strict", "replace"):
        raise GptkitError(f"data.encoding_errors={errors!r} must be strict or replace")


def decode(data: bytes, path: Path, errors: str) -> str:
    """bytes as UTF-8 with data.errors; an undecodable byte is an error naming the file and offset."""
    check_errors(errors)
    try:
        return data.decode("utf-8", errors=errors)
    except UnicodeDecodeError as exc:
        raise _bad_byte(path, exc.start, data[exc.start : exc.start + 1]) from None


def _decoded_chunks(path: Path, errors: str, size: int = READ_BYTES) -> Iterator[str]:
    """The text of a file, decoded `size` bytes at a time (a character cut by a chunk waits for the next);
    the first undecodable byte (errors=strict) is an error naming its offset."""
    check_errors(errors)
    decoder = codecs.getincrementaldecoder("utf-8")(errors)
    # bytes of the file before `chunk`
    offset = 0
    with open(path, "rb") as f:
        while True:
            chunk = f.read(size)
            # undecoded bytes carried over from the last chunk
            pending = len(decoder.getstate()[0])
            try:
                text = decoder.decode(chunk, final=not chunk)
            except UnicodeDecodeError as exc:
                at = offset - pending + exc.start if chunk else offset - len(exc.object) + exc.start
                raise _bad_byte(path, at, exc.object[exc.start : exc.start + 1]) from None
            if text:
                yield text
            if not chunk:
                return
            offset += len(chunk)


def check_utf8(path: Path) -> None:
    """Stream a file through a UTF-8 decoder; the first bad byte is an error naming its offset."""
    for _ in _decoded_chunks(path, "strict"):
        pass


def text_parts(f: Path, errors: str, blank: str) -> Iterator[Part]:
    """One text file as one document, in pieces of about READ_BYTES. A file of only whitespace is no
    document: skipped (blank="skip") or an error (blank="error")."""
    if blank == "error" and f.stat().st_size == 0:
        raise GptkitError(f"{f} is empty; remove it from data.paths or give it some text")
    # leading whitespace, until some text shows this is a document
    held: list[str] = []
    prev: str | None = None
    for text in _decoded_chunks(f, errors):
        if held is not None:
            held.append(text)
            if not text.strip():
                continue
            text, held = "".join(held), None  # type: ignore[assignment]
        if prev is not None:
            yield prev, False
        prev = text
    if prev is None:
        if blank == "error":
            raise GptkitError(f"{f} holds only whitespace; remove it from data.paths or give it some text")
        return
    yield prev, True


def _no_field(f: Path, text_field: str, fields: Any) -> GptkitError:
    return GptkitError(
        f"{f}: records have no field {text_field!r} (fields: {', '.join(map(str, fields))}); "
        f"set data.text_field"
    )


def _json_record(f: Path | str, line: bytes, at: int, errors: str) -> dict | None:
    """The record of one line of a JSON-lines file that starts at byte `at` (None: a blank line)."""
    if not line.strip():
        return None
    try:
        record = json.loads(line.decode("utf-8", errors=errors))
    except UnicodeDecodeError as exc:
        raise _bad_byte(Path(f), at + exc.start, line[exc.start : exc.start + 1]) from None
    except json.JSONDecodeError as exc:
        raise GptkitError(
            f"{f}: the line at byte {at} is not valid JSON ({exc.msg}); fix the file or set data.format"
        ) from None
    if not isinstance(record, dict):
        raise GptkitError(f"{f}: the line at byte {at} is not a JSON object; each line must be a record")
    return record


def jsonl_texts(
    f: Path,
    text_field: str,
    errors: str,
    start: int = 0,
    limit: int | None = None,
) -> Iterator[str]:
    """The text fields of a JSON-lines file, one line at a time (from byte `start`, at a line start; at most
    about `limit` bytes)."""
    offset, n, seen = start, 0, 0
    fields: Any = ()
    with open(f, "rb") as fh:
        fh.seek(start)
        for line in fh:
            at, offset = offset, offset + len(line)
            record = _json_record(f, line, at, errors)
            if record is None:
                continue
            seen += 1
            t = record.get(text_field)
            if text_field in record:
                n += 1
            elif seen <= RECORDS and n == 0:
                fields = fields or list(record)
                if seen == RECORDS:
                    raise _no_field(f, text_field, fields)
            if t:
                yield str(t)
            if limit is not None and offset - start >= limit:
                return
    if n == 0 and start == 0:
        raise _no_field(f, text_field, fields)


def is_jsonl(f: Path) -> bool:
    """A .jsonl file, or a .json file whose first record starts a line of its own (JSON lines)."""
    if f.suffix.lower() == ".jsonl":
        return True
    try:
        with open(f, "rb") as fh:
            head = fh.read(4096).lstrip()
    except OSError as exc:
        raise unreadable_file(f, exc) from None
    return head.startswith(b"{")


def text_records(f: Path, fmt: str, text_field: str, errors: str) -> Iterator[str]:
    """The text fields of the records of a json or parquet file, read RECORDS at a time."""
    if fmt == "json" and is_jsonl(f):
        yield from jsonl_texts(f, text_field, errors)
        return
    if fmt == "parquet":
        import pyarrow.parquet as pq

        try:
            pf = pq.ParquetFile(f)
        except Exception as exc:
            raise _unreadable(f, fmt, exc) from exc
        names = pf.schema_arrow.names
        if text_field not in names:
            raise _no_field(f, text_field, names)
        for batch in pf.iter_batches(batch_size=RECORDS, columns=[text_field]):
            yield from (str(t) for t in batch.column(0).to_pylist() if t)
        return
    # a JSON array: names the file and offset of a bad byte (datasets would not)
    check_utf8(f)
    import datasets

    datasets.disable_progress_bars()
    try:
        ds = datasets.load_dataset("json", data_files=[str(f)], split="train", streaming=True)
        for batch in ds.iter(batch_size=RECORDS):
            if text_field not in batch:
                raise _no_field(f, text_field, batch)
            yield from (str(t) for t in batch[text_field] if t)
    except GptkitError:
        raise
    except Exception as exc:
        raise _unreadable(f, fmt, exc) from exc


def _unreadable(f: Path, fmt: str, exc: Exception) -> GptkitError:
    msg = " ".join(str(exc).split())[:200]
    return GptkitError(
        f"{f}: cannot read it as {fmt} ({type(exc).__name__}: {msg}); check the file or set data.format"
    )


def _empty(f: Path | str) -> GptkitError:
    return GptkitError(f"{f} is empty; remove it from data.paths or give it some text")


def _no_texts(f: Path | str, text_field: str) -> GptkitError:
    return GptkitError(f"{f} has no non-empty {text_field!r} records")


def file_parts(f: Path, fmt: str, text_field: str, errors: str, blank: str = "error") -> Iterator[Part]:
    """The documents of one local file: the whole file (text) or one per record (json, parquet)."""
    if fmt == "text":
        yield from text_parts(f, errors, blank)
        return
    if f.stat().st_size == 0:
        raise _empty(f)
    n = 0
    for t in text_records(f, fmt, text_field, errors):
        n += 1
        yield t, True
    if n == 0:
        raise _no_texts(f, text_field)


@dataclass(frozen=True)
class LineRange:
    """Bytes [start, end) of a JSON-lines file, from a line start to a line start (or the file's end)."""

    path: str
    start: int
    end: int
    # of the whole file: end == size is its last range
    size: int
    text_field: str
    errors: str


@dataclass
class RangeStats:
    """What one range held, for the checks that span lines (RangeChecks): records (JSON objects) before the
    first bad line, those with the text field, the 1-based index of the first of them (0: none), the fields
    of the first record with any (and its index), and the first bad line's error (None: none)."""

    records: int = 0
    with_field: int = 0
    first_with_field: int = 0
    fields: list[str] | None = None
    fields_at: int = 0
    texts: int = 0
    error: GptkitError | None = None
    # the byte offset in the file of each record with a non-empty text (each a document), in order
    offsets: list[int] = field(default_factory=list)


def _line_end(fh: Any, pos: int, size: int) -> int:
    """The offset just after the newline at or after byte `pos` (the file's size if there is none), read in
    blocks of 4 kB, doubling up to 1 MB (a record is usually far shorter than a range)."""
    fh.seek(pos)
    block = 4 << 10
    while pos < size:
        data = fh.read(block)
        if not data:
            return size
        nl = data.find(b"\n")
        if nl != -1:
            return pos + nl + 1
        pos += len(data)
        block = min(2 * block, 1 << 20)
    return size


def line_ranges(files: list[Path], text_field: str, errors: str, step: int) -> Iterator[LineRange]:
    """The files as ranges of about `step` bytes, each ending at a line end: a seek and a short read per
    range, nothing else of the file is read. An empty file is one empty range (its reader says so)."""
    for f in files:
        size = os.stat(f).st_size
        start = 0
        with open(f, "rb") as fh:
            while True:
                end = size if start + step >= size else _line_end(fh, start + step - 1, size)
                yield LineRange(str(f), start, end, size, text_field, errors)
                if end >= size:
                    break
                start = end


def read_range(r: LineRange) -> tuple[list[str], RangeStats]:
    """The non-empty text fields of a range's records, and what the range held (RangeStats). A bad line
    (undecodable with errors=strict, not JSON, not an object) ends the range: its error is in the stats,
    raised by RangeChecks in order. An empty file is a GptkitError now."""
    if r.size == 0:
        raise _empty(r.path)
    with open(r.path, "rb") as fh:
        fh.seek(r.start)
        data = fh.read(r.end - r.start)
    texts: list[str] = []
    st = RangeStats()
    pos = 0
    try:
        while pos < len(data):
            nl = data.find(b"\n", pos)
            stop = len(data) if nl == -1 else nl + 1
            # the line's byte offset in the file
            at = r.start + pos
            record = _json_record(r.path, data[pos:stop], at, r.errors)
            pos = stop
            if record is None:
                continue
            st.records += 1
            if r.text_field in record:
                st.with_field += 1
                st.first_with_field = st.first_with_field or st.records
            elif st.fields is None and not st.with_field and record:
                st.fields, st.fields_at = list(record), st.records
            t = record.get(r.text_field)
            if t:
                texts.append(str(t))
                st.offsets.append(at)
    except GptkitError as exc:
        st.error = exc
    st.texts = len(texts)
    return texts, st


class RangeChecks:
    """The checks of jsonl_texts and file_parts that span lines, on a file's ranges in order: the first
    RECORDS records must hold the text field somewhere, and so must the file; it must have a non-empty text.
    They raise the errors of the line-by-line reader, in the order it raises them."""

    def __init__(self) -> None:
        self.path = ""
        self.records = self.with_field = self.texts = 0
        self.fields: list[str] = []

    def settled(self, r: LineRange) -> bool:
        """Nothing this range holds can fail a check that spans lines (the file has shown the text field and
        a text already): a range a killed build already wrote need not be read again."""
        return r.path == self.path and r.start > 0 and self.with_field > 0 and self.texts > 0

    def add(self, r: LineRange, st: RangeStats) -> None:
        """Account for one range (in order); raises the first error the line-by-line reader would."""
        if r.start == 0:
            self.path, self.records, self.with_field, self.texts, self.fields = r.path, 0, 0, 0, []
        if self.with_field == 0 and self.records < RECORDS:
            # the range's record that is the file's RECORDS-th
            k = RECORDS - self.records
            if st.fields is not None and st.fields_at <= k:
                self.fields = self.fields or st.fields
            if st.records >= k and not 0 < st.first_with_field <= k:
                raise _no_field(Path(r.path), r.text_field, self.fields)
        if st.error is not None:
            raise st.error
        self.records += st.records
        self.with_field += st.with_field
        self.texts += st.texts
        if r.end == r.size:
            if self.with_field == 0:
                raise _no_field(Path(r.path), r.text_field, self.fields)
            if self.texts == 0:
                raise _no_texts(r.path, r.text_field)
