"""Corpora: where the text comes from, as a stream of bounded pieces of documents, with a content
hash for the cache. Nothing here holds a whole file or a whole document: text files are read and
decoded a megabyte at a time, JSON lines one line at a time, parquet and hub datasets RECORDS records
at a time (a single record is held whole); reading local files is gptkit/data/files.py.

    data=pydoc    the interpreter's bundled reference documentation (pydoc_data, ~0.5 MB of English);
                  ships with every CPython, so it works offline with no download (the default)
    data=shakespeare  tiny Shakespeare (1.1 MB, public domain), shipped inside gptkit: one document,
                  the corpus of the reference recipe (experiment=shakespeare-char)
    data=stdlib   the standard library's own .py sources (~30 MB of code), also offline
    data=files    local .txt (one document per file), .json/.jsonl (one document per record's
                  text field) and .parquet files; globs; validation by fraction or by val_paths
    data=hub      a Hugging Face Hub dataset by name (and config), streamed; fails fast without network
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import sys
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

from gptkit.data.files import (
    RECORDS,
    LineRange,
    Part,
    Parts,
    check_errors,
    expand_paths,
    file_format,
    file_parts,
    files_digest,
    is_jsonl,
    jsonl_texts,
    line_ranges,
    spelled_in,
    text_parts,
)
from gptkit.errors import GptkitError
from gptkit.hub import check_hub_reachable, offline

# datasets (1.2 s of CPU to import), pyarrow and huggingface_hub are imported for the sources that read them.

# bytes of one window of an evenly spread sample of local files (at most)
SAMPLE_WINDOW = 256 << 10
# windows of a sample (at least)
SAMPLE_MIN_WINDOWS = 16


@dataclass
class Corpus:
    """The text of one corpus as a stream of bounded pieces (`Part`s): no document is ever held whole.
    `val_parts` is None when validation is a fraction of the tokens. `sample(chars)`, when set, yields
    about `chars` characters read at evenly spaced places (without reading the rest); None: the caller
    samples the stream itself."""

    description: str
    train_parts: Parts
    val_parts: Parts | None
    # hash of the content (computed on demand: it reads everything)
    sha256: Callable[[], str]
    # approximate size, for the progress bar
    n_bytes: int | None = None
    files: list[str] = field(default_factory=list)
    sample: Callable[[int], Iterator[str]] | None = None
    # JSON-lines files only: the splits as byte ranges of about `step` bytes, which tokenization workers
    # read, parse and cut themselves (the same documents as train_parts/val_parts); None: other corpora
    train_ranges: Callable[[int], Iterator[LineRange]] | None = None
    val_ranges: Callable[[int], Iterator[LineRange]] | None = None
    # text files only (each one document): the splits' files, which tokenization workers read in byte ranges
    # (gptkit.data.ranges.TextFeed); text_blank: what a file of only whitespace is (error, or skip); None:
    # other corpora
    train_text: list[Path] | None = None
    val_text: list[Path] | None = None
    text_errors: str = "strict"
    text_blank: str = "error"
    # whether the text may spell one of the strings (special tokens), read without tokenizing; None: the
    # corpus cannot tell (it may)
    spells: Callable[[list[str]], bool] | None = None
    # the splits' parts as sections, each named by where its documents come from (a file, a topic, a hub
    # dataset): the same documents as train_parts/val_parts, which a build records the source of (None: not
    # known)
    train_sections: Callable[[], Iterator[Section]] | None = None
    val_sections: Callable[[], Iterator[Section]] | None = None

    def all_parts(self) -> Iterator[Part]:
        yield from self.train_parts()
        if self.val_parts is not None:
            yield from self.val_parts()

    def train_docs(self) -> Iterator[str]:
        """Whole documents of the train split (joins the pieces: for small corpora and tests)."""
        return documents(self.train_parts())


def documents(parts: Iterator[Part]) -> Iterator[str]:
    """Whole documents from their pieces."""
    buf: list[str] = []
    for text, last in parts:
        buf.append(text)
        if last:
            yield "".join(buf)
            buf = []


# (where its documents come from: a file, a topic, a dataset; its documents as parts)
Section = tuple[str, Parts]


def chained(sections: Callable[[], Iterator[Section]]) -> Parts:
    """The parts of every section, one after another."""
    return lambda: (p for _, parts in sections() for p in parts())


def whole(docs: Callable[[], Iterator[str]]) -> Parts:
    """Parts of documents that are small enough to be held (the built-in corpora, json records)."""
    return lambda: ((d, True) for d in docs())


def _digest(parts: Iterator[bytes]) -> str:
    h = hashlib.sha256()
    for p in parts:
        # hash of hashes: document boundaries count
        h.update(hashlib.sha256(p).digest())
    return h.hexdigest()


# ---- built-in corpora ------------------------------------------------------------------------------
def pydoc(s: dict[str, Any]) -> Corpus:
    """data=pydoc: the interpreter's bundled reference documentation, one document per topic."""
    from pydoc_data.topics import topics

    def docs() -> Iterator[str]:
        for name in sorted(topics):
            yield topics[name]

    def sections() -> Iterator[Section]:
        for name in sorted(topics):
            yield f"pydoc topic {name!r}", whole(lambda name=name: iter([topics[name]]))

    return Corpus(
        description=f"pydoc_data topics of Python {sys.version.split()[0]} ({len(topics)} documents)",
        train_parts=whole(docs),
        val_parts=None,
        sha256=lambda: _digest(d.encode() for d in docs()),
        n_bytes=sum(len(t) for t in topics.values()),
        spells=lambda strings: any(t in d for d in docs() for t in strings),
        train_sections=sections,
    )


SHAKESPEARE = Path(__file__).resolve().parent / "corpora" / "tinyshakespeare.txt.gz"


def shakespeare_text() -> str:
    """Tiny Shakespeare (Karpathy's char-rnn corpus: 1,115,394 characters of the plays, public domain),
    shipped gzipped inside gptkit so that the reference recipe runs offline from any clone or wheel."""
    if not SHAKESPEARE.is_file():
        raise GptkitError(f"the built-in corpus {SHAKESPEARE} is missing; reinstall gptkit")
    return gzip.decompress(SHAKESPEARE.read_bytes()).decode("utf-8")


def shakespeare(s: dict[str, Any]) -> Corpus:
    """data=shakespeare: tiny Shakespeare, one document."""

    def docs() -> Iterator[str]:
        # one document, as char-rnn and nanoGPT treat it
        yield shakespeare_text()

    return Corpus(
        description="tiny Shakespeare (built in, 1.1 MB)",
        train_parts=whole(docs),
        val_parts=None,
        sha256=lambda: _digest(d.encode() for d in docs()),
        n_bytes=1_115_394,
        spells=lambda strings: any(t in d for d in docs() for t in strings),
        train_sections=lambda: iter([("tiny Shakespeare (built in)", whole(docs))]),
    )


def stdlib_files(include_tests: bool = True) -> list[Path]:
    """The .py files of this interpreter's standard library in a fixed order (the data=stdlib corpus)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "__pycache__"}
    if not include_tests:
        skip |= {"test", "tests", "idle_test"}
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in skip)
        out += [Path(dirpath) / f for f in sorted(filenames) if f.endswith(".py")]
    return out


def stdlib(s: dict[str, Any]) -> Corpus:
    """data=stdlib: the standard library's .py files, one document each."""
    files = stdlib_files(bool(s["include_tests"]))
    root = Path(sysconfig.get_paths()["stdlib"])
    c = _text_files(files, s["encoding_errors"])
    c.description = (
        f"Python {sys.version.split()[0]} standard library sources in {root} ({len(files)} .py files)"
    )
    return c


# ---- JSON-lines files in byte ranges ---------------------------------------------------------------
# A JSON-lines record is a whole document, so a file can be cut at any line start into ranges that are
# read, parsed, cut and encoded independently (by the tokenization workers: gptkit.data.ranges). What the
# line-by-line reader above checks across lines is checked in order by RangeChecks, with its messages.
# False: JSON-lines corpora are read line by line in the main process (as before)
JSONL_RANGES = True
# False: text files are read, decoded and cut in the main process (as before)
TEXT_RANGES = True


def _sample_local(
    files: list[Path],
    formats: list[str],
    text_field: str,
    errors: str,
) -> Callable[[int], Iterator[str]] | None:
    """About `chars` characters from windows at evenly spaced byte offsets of the text and JSON-lines
    files (None when some file is neither: the caller then samples the stream)."""
    if not all(ff == "text" or (ff == "json" and is_jsonl(f)) for f, ff in zip(files, formats)):
        return None
    sizes = [f.stat().st_size for f in files]

    def sample(chars: int) -> Iterator[str]:
        total = sum(sizes)
        k = max(SAMPLE_MIN_WINDOWS, -(-chars // SAMPLE_WINDOW))
        window = max(1, -(-chars // k))
        bounds = [0]
        for size in sizes:
            bounds.append(bounds[-1] + size)
        fi = 0
        for i in range(k):
            at = i * total // k
            while bounds[fi + 1] <= at:
                fi += 1
            f, local = files[fi], at - bounds[fi]
            if formats[fi] == "json":
                if local:
                    with open(f, "rb") as fh:
                        fh.seek(local)
                        # to the next line start
                        local += len(fh.readline())
                yield from jsonl_texts(f, text_field, "replace", local, window)
                continue
            with open(f, "rb") as fh:
                fh.seek(local)
                data = fh.read(window)
            # start and end at line breaks
            if local and b"\n" in data:
                data = data[data.index(b"\n") + 1 :]
            if len(data) == window and b"\n" in data:
                data = data[: data.rindex(b"\n") + 1]
            yield data.decode("utf-8", errors="ignore")

    return sample


def _text_files(files: list[Path], errors: str) -> Corpus:
    def sections() -> Iterator[Section]:
        for f in files:
            # the many empty __init__.py files are not documents
            yield str(f), lambda f=f: text_parts(f, errors, "skip")

    return Corpus(
        description="",
        train_parts=chained(sections),
        train_sections=sections,
        val_parts=None,
        sha256=lambda: files_digest(files),
        n_bytes=sum(f.stat().st_size for f in files),
        files=[str(f) for f in files],
        sample=_sample_local(files, ["text"] * len(files), "text", errors),
        train_text=files if TEXT_RANGES else None,
        text_errors=errors,
        text_blank="skip",
        spells=lambda strings: spelled_in(files, strings, ["text"] * len(files)),
    )


def _local(
    files: list[Path], fmt: str, text_field: str, errors: str
) -> tuple[Callable[[], Iterator[Section]], Callable[[], str]]:
    formats = [file_format(f, fmt) for f in files]

    def sections() -> Iterator[Section]:
        for f, ff in zip(files, formats):
            yield str(f), lambda f=f, ff=ff: file_parts(f, ff, text_field, errors)

    return sections, lambda: files_digest(files)


def local_files(s: dict[str, Any]) -> Corpus:
    files = expand_paths(s["paths"], "data.paths")
    if not files:
        raise GptkitError("data=files needs data.paths=[file.txt,...] (files or globs)")
    val_files = expand_paths(s["val_paths"], "data.val_paths")
    fmt, field_, errors = s["format"], s["text_field"], s["encoding_errors"]
    check_errors(errors)
    train, train_hash = _local(files, fmt, field_, errors)
    val, val_hash = _local(val_files, fmt, field_, errors) if val_files else (None, None)
    names = ", ".join(str(f) for f in files[:3]) + (f" and {len(files) - 3} more" if len(files) > 3 else "")
    desc = f"local files: {names}" + (f"; validation: {len(val_files)} file(s)" if val_files else "")
    every = files + val_files
    corpus = Corpus(
        description=desc,
        train_parts=chained(train),
        val_parts=chained(val) if val is not None else None,
        train_sections=train,
        val_sections=val,
        sha256=lambda: train_hash() + (val_hash() if val_hash else ""),
        n_bytes=sum(f.stat().st_size for f in every),
        files=[str(f) for f in every],
        sample=_sample_local(every, [file_format(f, fmt) for f in every], field_, errors),
        spells=lambda strings: spelled_in(every, strings, [file_format(f, fmt) for f in every]),
    )
    if JSONL_RANGES and all(file_format(f, fmt) == "json" and is_jsonl(f) for f in every):
        corpus.train_ranges = lambda step: line_ranges(files, field_, errors, step)
        if val_files:
            corpus.val_ranges = lambda step: line_ranges(val_files, field_, errors, step)
    if TEXT_RANGES and all(file_format(f, fmt) == "text" for f in every):
        corpus.train_text, corpus.val_text, corpus.text_errors = files, val_files or None, errors
    return corpus


# ---- Hugging Face Hub ------------------------------------------------------------------------------
LOCAL_FILES = "without network use local files: data=files data.paths=[corpus.txt]"


def _offline() -> bool:
    return offline("HF_DATASETS_OFFLINE")


# an evenly spread sample of a streamed dataset reads this many of its shards
HUB_SAMPLE_SHARDS = 16


def hub(s: dict[str, Any]) -> Corpus:
    """A Hub dataset, streamed (datasets' `streaming=True`): nothing is downloaded before tokenization, and
    its shards are read in order. The cache key is the dataset's resolved commit when the hub answers."""
    name, config = s["name"], s["config"]
    if not name:
        raise GptkitError(
            "data=hub needs data.name=<dataset>, e.g. data.name=Salesforce/wikitext "
            "data.config=wikitext-2-raw-v1"
        )
    if not _offline():
        check_hub_reachable(float(s["timeout_s"]), LOCAL_FILES)
    import datasets

    datasets.disable_progress_bars()
    text_field = s["text_field"]

    def fail(split: str, exc: Exception) -> GptkitError:
        msg = " ".join(str(exc).split())[:200]
        hint = (
            "the hub is unreachable (offline mode) and the dataset is not in the local cache; "
            if _offline()
            else ""
        )
        return GptkitError(
            f"cannot load hub dataset {name!r} (config {config!r}, split {split!r}): {hint}"
            f"{type(exc).__name__}: {msg}; {LOCAL_FILES}"
        )

    def load(split: str):
        try:
            ds = datasets.load_dataset(name, config, split=split, revision=s["revision"], streaming=True)
        except Exception as exc:
            raise fail(split, exc) from None
        columns = getattr(ds, "column_names", None)
        if columns is not None and text_field not in columns:
            raise GptkitError(
                f"hub dataset {name!r} has no column {text_field!r} (columns: "
                f"{', '.join(columns)}); set data.text_field"
            )
        return ds

    def texts(ds, split: str) -> Iterator[str]:
        try:
            for batch in ds.iter(batch_size=RECORDS):
                if text_field not in batch:
                    raise GptkitError(
                        f"hub dataset {name!r} has no column {text_field!r} (columns: "
                        f"{', '.join(batch)}); set data.text_field"
                    )
                yield from (str(t) for t in batch[text_field] if t)
        except GptkitError:
            raise
        except Exception as exc:
            raise fail(split, exc) from None

    train = load(s["split"])
    val = load(s["val_split"]) if s["val_split"] else None

    def parts(ds, split: str) -> Parts:
        return lambda: ((t, True) for t in texts(ds, split))

    def sections(ds, split: str) -> Callable[[], Iterator[Section]]:
        # the streamed split is one source: its documents counted in order
        where = f"hub dataset {name}" + (f" ({config})" if config else "") + f", split {split}"
        return lambda: iter([(where, parts(ds, split))])

    def sample(chars: int) -> Iterator[str]:
        """`chars` characters from up to HUB_SAMPLE_SHARDS evenly spaced shards of the train split."""
        n = int(getattr(train, "n_shards", 1) or 1)
        picks = sorted({i * n // min(n, HUB_SAMPLE_SHARDS) for i in range(min(n, HUB_SAMPLE_SHARDS))})
        each = -(-chars // len(picks))
        for i in picks:
            got = 0
            shard = train.shard(num_shards=n, index=i) if n > 1 else train
            for t in texts(shard, s["split"]):
                yield t[: each - got]
                got += min(len(t), each - got)
                if got >= each:
                    break

    identity = {
        "name": name,
        "config": config,
        "split": s["split"],
        "val_split": s["val_split"],
        "revision": _hub_commit(name, s["revision"]),
    }
    size = _hub_bytes(train, s["split"])
    return Corpus(
        description=f"hub dataset {name}" + (f" ({config})" if config else "") + ", streamed",
        train_parts=parts(train, s["split"]),
        val_parts=parts(val, s["val_split"]) if val is not None else None,
        sha256=lambda: hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest(),
        n_bytes=size,
        sample=sample,
        train_sections=sections(train, s["split"]),
        val_sections=sections(val, s["val_split"]) if val is not None else None,
    )


def _hub_commit(name: str, revision: str | None) -> str | None:
    """The commit a revision (None: the main branch) names now, so that a dataset updated upstream is a new
    cache entry; offline (or unanswered): the revision as given."""
    if _offline():
        return revision
    try:
        from huggingface_hub import HfApi

        return HfApi().dataset_info(name, revision=revision, timeout=10).sha or revision
    except Exception:  # noqa: BLE001 - a local path or script dataset: the load itself reports real problems
        return revision


def _hub_bytes(ds, split: str) -> int | None:
    """The split's size in bytes when the dataset's metadata says it (for the progress and the sample)."""
    try:
        info = ds.info.splits[split]
        return int(info.num_bytes) or None
    except Exception:  # noqa: BLE001 - no metadata: the size is unknown
        return None
