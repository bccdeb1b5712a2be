"""Corpora: where the text comes from, as documents (str), with a content hash for the cache.

    data=pydoc    the interpreter's bundled reference documentation (pydoc_data, ~0.5 MB of English);
                  ships with every CPython, so it works offline with no download (the default)
    data=shakespeare  tiny Shakespeare (1.1 MB, public domain), shipped inside gptkit: one document,
                  the corpus of the reference recipe (experiment=shakespeare-char)
    data=stdlib   the standard library's own .py sources (~30 MB of code), also offline
    data=files    local .txt (one document per file), .json/.jsonl (one document per record's
                  text field) and .parquet files; globs; validation by fraction or by val_paths
    data=hub      a Hugging Face Hub dataset by name (and config); fails fast without network

Text files must be UTF-8. `encoding_errors: strict` (the default for files) stops at the first
undecodable byte and names the file and byte offset; `replace` substitutes U+FFFD and goes on.
JSON files must be valid UTF-8 either way (the JSON reader has no replacement policy).
"""

from __future__ import annotations

import codecs
import glob
import hashlib
import os
import sys
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

from gptkit.errors import GptkitError
from gptkit.hub import check_hub_reachable, offline

KINDS = ("pydoc", "shakespeare", "stdlib", "files", "hub", "prepared")
FORMATS = ("auto", "text", "json", "parquet")
Docs = Callable[[], Iterator[str]]  # a callable that starts a fresh pass over the documents


@dataclass
class Corpus:
    """Documents of one corpus. `val_docs` is None when validation is a fraction of the tokens."""

    description: str
    train_docs: Docs
    val_docs: Docs | None
    sha256: Callable[[], str]  # hash of the content (computed on demand: it reads everything)
    n_bytes: int | None = None  # approximate size, for the progress bar
    files: list[str] = field(default_factory=list)

    def all_docs(self) -> Iterator[str]:
        yield from self.train_docs()
        if self.val_docs is not None:
            yield from self.val_docs()


def open_corpus(s: dict[str, Any]) -> Corpus:
    """The corpus the (complete, plain dict) data settings describe. Checks paths now; reads text lazily."""
    kind = s["kind"]
    if kind == "pydoc":
        return _pydoc()
    if kind == "shakespeare":
        return _shakespeare()
    if kind == "stdlib":
        return _stdlib(s)
    if kind == "files":
        return _files(s)
    if kind == "hub":
        return _hub(s)
    raise GptkitError(f"unknown data kind {kind!r}; use data=pydoc|shakespeare|stdlib|files|hub|prepared")


def _digest(parts: Iterator[bytes]) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(hashlib.sha256(p).digest())  # hash of hashes: document boundaries count
    return h.hexdigest()


def _files_digest(files: list[Path]) -> str:
    h = hashlib.sha256()
    for f in files:
        with open(f, "rb") as fh:
            h.update(hashlib.file_digest(fh, "sha256").digest())
    return h.hexdigest()


# ---- built-in corpora ------------------------------------------------------------------------------
def _pydoc() -> Corpus:
    from pydoc_data.topics import topics

    def docs() -> Iterator[str]:
        for name in sorted(topics):
            yield topics[name]

    return Corpus(description=f"pydoc_data topics of Python {sys.version.split()[0]} ({len(topics)} documents)",
                  train_docs=docs, val_docs=None, sha256=lambda: _digest(d.encode() for d in docs()),
                  n_bytes=sum(len(t) for t in topics.values()))


SHAKESPEARE = Path(__file__).resolve().parent / "corpora" / "tinyshakespeare.txt.gz"


def shakespeare_text() -> str:
    """Tiny Shakespeare (Karpathy's char-rnn corpus: 1,115,394 characters of the plays, public domain),
    shipped gzipped inside gptkit so that the reference recipe runs offline from any clone or wheel."""
    import gzip

    if not SHAKESPEARE.is_file():
        raise GptkitError(f"the built-in corpus {SHAKESPEARE} is missing; reinstall gptkit")
    return gzip.decompress(SHAKESPEARE.read_bytes()).decode("utf-8")


def _shakespeare() -> Corpus:
    def docs() -> Iterator[str]:
        yield shakespeare_text()  # one document, as char-rnn and nanoGPT treat it

    return Corpus(description="tiny Shakespeare (built in, 1.1 MB)", train_docs=docs, val_docs=None,
                  sha256=lambda: _digest(d.encode() for d in docs()), n_bytes=1_115_394)


def stdlib_files(include_tests: bool = True) -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "__pycache__"}
    if not include_tests:
        skip |= {"test", "tests", "idle_test"}
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in skip)
        out += [Path(dirpath) / f for f in sorted(filenames) if f.endswith(".py")]
    return out


def _stdlib(s: dict[str, Any]) -> Corpus:
    files = stdlib_files(bool(s["include_tests"]))
    root = Path(sysconfig.get_paths()["stdlib"])
    c = _text_files(files, s["encoding_errors"])
    c.description = f"Python {sys.version.split()[0]} standard library sources in {root} ({len(files)} .py files)"
    return c


# ---- local files -----------------------------------------------------------------------------------
def expand_paths(patterns: Any, what: str) -> list[Path]:
    """Paths and globs -> existing files, in the given order (each glob sorted)."""
    if patterns is None or isinstance(patterns, str):
        patterns = [] if patterns is None else [patterns]
    out: list[Path] = []
    for pat in patterns:
        pat = os.path.expanduser(str(pat))
        if glob.has_magic(pat):
            found = sorted(p for p in glob.glob(pat, recursive=True) if os.path.isfile(p))
            if not found:
                raise GptkitError(f"{what}: the glob {pat!r} matches no files; check the path")
            out += [Path(p).resolve() for p in found]
            continue
        p = Path(pat)
        if not p.exists():
            raise GptkitError(f"{what}: {p} does not exist; give existing files, e.g. data.paths=[corpus.txt]")
        if p.is_dir():
            raise GptkitError(f"{what}: {p} is a folder; give files or a glob such as '{p}/**/*.txt'")
        out.append(p.resolve())
    return out


def file_format(p: Path, fmt: str) -> str:
    if fmt not in FORMATS:
        raise GptkitError(f"data.format={fmt!r} is not one of {', '.join(FORMATS)}")
    if fmt != "auto":
        return fmt
    suffix = p.suffix.lower()
    return {".json": "json", ".jsonl": "json", ".parquet": "parquet"}.get(suffix, "text")


def _bad_byte(path: Path, offset: int, byte: bytes) -> GptkitError:
    return GptkitError(f"{path}: byte {offset} ({byte!r}) is not valid UTF-8; fix the file or set "
                       f"data.encoding_errors=replace to substitute U+FFFD")


def decode(data: bytes, path: Path, errors: str) -> str:
    if errors not in ("strict", "replace"):
        raise GptkitError(f"data.encoding_errors={errors!r} must be strict or replace")
    try:
        return data.decode("utf-8", errors=errors)
    except UnicodeDecodeError as exc:
        raise _bad_byte(path, exc.start, data[exc.start:exc.start + 1]) from None


def check_utf8(path: Path) -> None:
    """Stream a file through a UTF-8 decoder; the first bad byte is an error naming its offset."""
    decoder = codecs.getincrementaldecoder("utf-8")("strict")
    offset = 0  # bytes of the file before `chunk`
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            pending = len(decoder.getstate()[0])  # undecoded bytes carried over from the last chunk
            try:
                decoder.decode(chunk)
            except UnicodeDecodeError as exc:
                raise _bad_byte(path, offset - pending + exc.start, exc.object[exc.start:exc.start + 1]) from None
            offset += len(chunk)
        try:
            decoder.decode(b"", final=True)
        except UnicodeDecodeError as exc:
            raise _bad_byte(path, offset - len(exc.object) + exc.start, exc.object[exc.start:exc.start + 1]) from None


def _text_files(files: list[Path], errors: str) -> Corpus:
    def docs() -> Iterator[str]:
        for f in files:
            text = decode(f.read_bytes(), f, errors)
            if text.strip():  # the many empty __init__.py files are not documents
                yield text

    return Corpus(description="", train_docs=docs, val_docs=None,
                  sha256=lambda: _files_digest(files),
                  n_bytes=sum(f.stat().st_size for f in files), files=[str(f) for f in files])


def _file_docs(f: Path, fmt: str, text_field: str, errors: str) -> Iterator[str]:
    """The documents of one local file: the whole file (text) or one per record (json, parquet)."""
    if f.stat().st_size == 0:
        raise GptkitError(f"{f} is empty; remove it from data.paths or give it some text")
    if fmt == "text":
        text = decode(f.read_bytes(), f, errors)
        if not text.strip():
            raise GptkitError(f"{f} holds only whitespace; remove it from data.paths or give it some text")
        yield text
        return
    if fmt == "json":
        check_utf8(f)  # names the file and offset of a bad byte (datasets would not)
    import datasets

    datasets.disable_progress_bars()
    try:
        ds = datasets.load_dataset(fmt, data_files=[str(f)], split="train", streaming=True)
        n = 0
        for batch in ds.iter(batch_size=1000):
            if text_field not in batch:
                raise GptkitError(f"{f}: records have no field {text_field!r} (fields: {', '.join(batch)}); "
                                  f"set data.text_field")
            for t in batch[text_field]:
                if t:
                    n += 1
                    yield str(t)
    except GptkitError:
        raise
    except Exception as exc:
        msg = " ".join(str(exc).split())[:200]
        raise GptkitError(f"{f}: cannot read it as {fmt} ({type(exc).__name__}: {msg}); "
                          f"check the file or set data.format") from exc
    if n == 0:
        raise GptkitError(f"{f} has no non-empty {text_field!r} records")


def _local(files: list[Path], fmt: str, text_field: str, errors: str) -> tuple[Docs, Callable[[], str]]:
    formats = [file_format(f, fmt) for f in files]

    def docs() -> Iterator[str]:
        for f, ff in zip(files, formats):
            yield from _file_docs(f, ff, text_field, errors)

    return docs, lambda: _files_digest(files)


def _files(s: dict[str, Any]) -> Corpus:
    files = expand_paths(s["paths"], "data.paths")
    if not files:
        raise GptkitError("data=files needs data.paths=[file.txt,...] (files or globs)")
    val_files = expand_paths(s["val_paths"], "data.val_paths")
    fmt, field_, errors = s["format"], s["text_field"], s["encoding_errors"]
    train, train_hash = _local(files, fmt, field_, errors)
    val, val_hash = _local(val_files, fmt, field_, errors) if val_files else (None, None)
    names = ", ".join(str(f) for f in files[:3]) + (f" and {len(files) - 3} more" if len(files) > 3 else "")
    desc = f"local files: {names}" + (f"; validation: {len(val_files)} file(s)" if val_files else "")
    return Corpus(description=desc, train_docs=train, val_docs=val,
                  sha256=lambda: train_hash() + (val_hash() if val_hash else ""),
                  n_bytes=sum(f.stat().st_size for f in files + val_files),
                  files=[str(f) for f in files + val_files])


# ---- Hugging Face Hub ------------------------------------------------------------------------------
LOCAL_FILES = "without network use local files: data=files data.paths=[corpus.txt]"


def _offline() -> bool:
    return offline("HF_DATASETS_OFFLINE")


def _hub(s: dict[str, Any]) -> Corpus:
    name, config = s["name"], s["config"]
    if not name:
        raise GptkitError("data=hub needs data.name=<dataset>, e.g. data.name=Salesforce/wikitext "
                          "data.config=wikitext-2-raw-v1")
    if not _offline():
        check_hub_reachable(float(s["timeout_s"]), LOCAL_FILES)
    import datasets

    def load(split: str):
        try:
            return datasets.load_dataset(name, config, split=split, revision=s["revision"])
        except Exception as exc:
            msg = " ".join(str(exc).split())[:200]
            hint = ("the hub is unreachable (offline mode) and the dataset is not in the local cache; "
                    if _offline() else "")
            raise GptkitError(f"cannot load hub dataset {name!r} (config {config!r}, split {split!r}): {hint}"
                              f"{type(exc).__name__}: {msg}; {LOCAL_FILES}") from None

    text_field = s["text_field"]
    train = load(s["split"])
    val = load(s["val_split"]) if s["val_split"] else None
    for ds in (train, val):
        if ds is not None and text_field not in ds.column_names:
            raise GptkitError(f"hub dataset {name!r} has no column {text_field!r} (columns: "
                              f"{', '.join(ds.column_names)}); set data.text_field")

    def docs(ds) -> Docs:
        def gen() -> Iterator[str]:
            for batch in ds.iter(batch_size=1000):
                yield from (t for t in batch[text_field] if t)
        return gen

    return Corpus(description=f"hub dataset {name}" + (f" ({config})" if config else ""),
                  train_docs=docs(train), val_docs=docs(val) if val is not None else None,
                  sha256=lambda: train._fingerprint + (val._fingerprint if val is not None else ""),
                  n_bytes=None)
