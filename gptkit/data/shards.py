"""Writing token shards: each split's ids appended in input order, committed every SHARD_TOKENS tokens.

A build's `progress.json` (the Journal) records, for each split, how much of its shard is complete (its
length, CRC-32 and how many tasks of the input it holds, and the length of its documents file: where each
document ends and where it came from, for `gptkit trace`), synced at every commit. A build killed at any
moment is continued: the shard is cut back to its last complete length (resume_shard checks that prefix
against its CRC-32), the tasks it holds are skipped, and the rest is written as before, so the result is
bit-identical to an uninterrupted build (gptkit/data/build.py says how a build is found and finished).
"""

from __future__ import annotations

import json
import os
import zlib
from collections import deque
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from gptkit.data.console import Progress, say
from gptkit.data.files import Part, Parts
from gptkit.data.prepared import DTYPES, copy_tail
from gptkit.data.provenance import DOC_ROW, DOCS_SUFFIX
from gptkit.data.workers import Tokenizing, encode_task, text_bytes
from gptkit.errors import GptkitError
from gptkit.faults import fault_point
from gptkit.fsio import atomic_write_text

# tokens between two commits of a build (a kill loses at most this much work)
SHARD_TOKENS = 16 << 20
# in a build folder: what is complete
PROGRESS = "progress.json"


class Journal:
    """progress.json of a build folder: what of each split's shard is complete (synced)."""

    def __init__(self, folder: Path, state: dict[str, Any]) -> None:
        self.folder, self.state = folder, state

    def split(self, name: str) -> dict[str, Any]:
        return self.state["splits"].setdefault(
            name, {"batches": 0, "bytes": 0, "crc32": 0, "tokens": 0, "documents": 0, "done": False}
        )

    def save(self) -> None:
        atomic_write_text(self.folder / PROGRESS, json.dumps(self.state, indent=1))


def resume_shard(path: Path, sp: dict[str, Any]) -> bool:
    """Cut the shard back to its last complete length and check that prefix's CRC-32."""
    if not path.is_file() or path.stat().st_size < sp["bytes"]:
        return False
    os.truncate(path, sp["bytes"])
    crc = 0
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(8 << 20), b""):
            crc = zlib.crc32(block, crc)
    return crc == sp["crc32"]


def logged(sections: Iterator[tuple[str, Parts]], log: deque[str]) -> Iterator[Part]:
    """The parts of the sections, one after another, with the section of each document that has any text (a
    document Cutter.pieces makes pieces of) put on `log` when its last part is given out: before any piece of
    that document can reach a task, so a task's result finds its documents' sources there."""
    for name, parts in sections:
        has_text = False
        for text, last in parts():
            has_text = has_text or bool(text)
            if last:
                if has_text:
                    log.append(name)
                has_text = False
            yield text, last


class BatchFeed:
    """The tasks of one split of any corpus for write_tokens: batches of pieces that this process reads and
    cuts, which the workers encode (encode_task). (JSON-lines corpora: gptkit.data.ranges.RangeFeed.)
    `log`: the source of each document as the pieces were cut (logged), when the corpus names them."""

    run = staticmethod(encode_task)
    # counted by the Cutter of this process
    forced = 0

    def __init__(self, work: Iterator[list[tuple[str, bool, bool]]], log: deque[str] | None = None) -> None:
        self.work, self.log = work, log

    def tasks(self) -> Iterator[list[tuple[str, bool, bool]]]:
        return self.work

    def skipped(self, batch: list[tuple[str, bool, bool]]) -> int:
        """A batch a killed build already wrote: its bytes, for the progress (its documents' sources are in
        the documents file already)."""
        if self.log is not None:
            for _ in range(sum(1 for piece in batch if piece[1])):
                self.log.popleft()
        return text_bytes(batch)

    def done(self, result: tuple) -> None:
        """Nothing to check: the reading and cutting here raised any error already."""

    def documents(self, result: tuple) -> list[tuple[str | None, int]]:
        """(source, -1: its byte offset is not known) of each document the result ends."""
        n = len(result[1])
        if self.log is None:
            return [(None, -1)] * n
        return [(self.log.popleft(), -1) for _ in range(n)]


class Documents:
    """<split>.docs of a build: one DOC_ROW per document of the split's shard, in order (where its tokens end,
    its source, its number within that source, its byte offset there), appended as the shard is and committed
    with it (its length in the journal: `doc_bytes`). The sources' names are the journal's `sources`."""

    def __init__(self, path: Path, journal: Journal, sp: dict[str, Any]) -> None:
        self.path, self.journal, self.sp = path, journal, sp
        self.sources: list[str] = journal.state.setdefault("sources", [])
        self.index = {name: i for i, name in enumerate(self.sources)}
        # a split begun by a gptkit that recorded no documents: none for it
        if "doc_bytes" not in sp:
            sp["doc_bytes"] = 0 if sp["tokens"] == 0 else None
        self.on = sp["doc_bytes"] is not None
        # documents so far of each source (its next document's number)
        self.records: dict[int, int] = {}
        if self.on and sp["doc_bytes"]:
            rows = np.fromfile(path, dtype=DOC_ROW, count=sp["doc_bytes"] // DOC_ROW.itemsize)
            sources, counts = np.unique(rows["source"], return_counts=True)
            self.records = {int(k): int(c) for k, c in zip(sources, counts)}
        self.file = open(path, "ab") if self.on else None

    def add(self, start: int, ends: np.ndarray, origins: list[tuple[str | None, int]]) -> None:
        """The documents a task ended: their ends (positions after `start`, the split's tokens before the
        task) and (source, byte offset) of each."""
        if not self.on:
            return
        if len(origins) != len(ends):
            # a source not told right: the ids are right, and no documents are recorded rather than wrong ones
            self.stop("the sources of its documents went out of step")
            return
        sources, records = [], []
        for name, _ in origins:
            k = -1
            if name is not None:
                k = self.index.get(name)
                if k is None:
                    k = self.index[name] = len(self.sources)
                    self.sources.append(name)
            sources.append(k)
            records.append(self.records.get(k, 0))
            self.records[k] = records[-1] + 1
        rows = np.zeros(len(ends), dtype=DOC_ROW)
        rows["end"] = start + ends
        rows["source"], rows["record"] = sources, records
        rows["offset"] = [offset for _, offset in origins]
        data = rows.tobytes()
        self.file.write(data)
        self.sp["doc_bytes"] += len(data)

    def stop(self, why: str) -> None:
        say(f"note: the documents of this build are not recorded ({why}); `gptkit trace` shows token offsets")
        self.on = False
        self.sp["doc_bytes"] = None

    def sync(self) -> None:
        if self.file is not None:
            self.file.flush()
            os.fsync(self.file.fileno())

    def close(self) -> None:
        if self.file is not None:
            self.file.close()


def resume_documents(path: Path, sp: dict[str, Any]) -> None:
    """Cut a killed build's documents file back to its last committed length (none recorded: it goes)."""
    want = sp.get("doc_bytes")
    if want is not None and path.is_file() and path.stat().st_size >= want:
        os.truncate(path, want)
    elif want:
        # shorter than its record: the split's documents are not known
        sp["doc_bytes"] = None
        path.unlink(missing_ok=True)


def write_tokens(
    tokenizing: Tokenizing,
    feed: Any,
    out: Path,
    journal: Journal,
    split: str,
    progress: Progress,
) -> tuple[int, int]:
    """Tokenize the feed's tasks into `out` (appended raw ids), committing every SHARD_TOKENS tokens and
    skipping the tasks a killed build already committed; each document's end and source go to `out`'s .docs
    beside it (Documents). Returns (tokens, documents) of the split."""
    sp = journal.split(split)
    if sp["done"]:
        return sp["tokens"], sp["documents"]
    # tasks, whichever the feed's (layout() says which)
    skip = sp["batches"]
    # a killed build's complete shards
    progress.advance(0, sp["tokens"])

    def todo() -> Iterator[Any]:
        for i, b in enumerate(feed.tasks()):
            # already in the shard
            if i < skip:
                progress.advance(feed.skipped(b), skipped=True)
                continue
            yield b

    since = 0
    docs = Documents(out.with_suffix(DOCS_SUFFIX), journal, sp)
    try:
        with open(out, "ab") as f:
            for result in tokenizing.map(todo(), feed.run):
                feed.done(result)
                arr, ends, n_bytes = result[:3]
                docs.add(sp["tokens"], ends, feed.documents(result))
                data = arr.tobytes()
                f.write(data)
                sp["crc32"] = zlib.crc32(data, sp["crc32"])
                sp["bytes"] += len(data)
                sp["tokens"] += len(arr)
                sp["documents"] += len(ends)
                sp["batches"] += 1
                since += len(arr)
                progress.advance(n_bytes, len(arr))
                fault_point("prepare-batch")
                if since >= SHARD_TOKENS:
                    commit(f, journal, docs)
                    since = 0
            sp["done"] = True
            commit(f, journal, docs)
    finally:
        docs.close()
    return sp["tokens"], sp["documents"]


def commit(f, journal: Journal, docs: Documents | None = None) -> None:
    f.flush()
    os.fsync(f.fileno())
    if docs is not None:
        docs.sync()
    journal.save()
    fault_point("prepare-shard")


def split_tail(
    all_bin: Path, train_bin: Path, val_bin: Path, n: int, dtype: str, fraction: float, journal: Journal
) -> tuple[int, int]:
    """Move the last `fraction` of the tokens of all_bin into val_bin; the rest becomes train_bin. Each step
    is recorded, so that a build killed in between finishes it."""
    n_val = int(round(n * fraction))
    if n_val < 1 or n - n_val < 1:
        raise GptkitError(
            f"the corpus has only {n} tokens: too short to split off "
            f"data.val_fraction={fraction}; give more text"
        )
    itemsize = DTYPES[dtype]
    if not journal.state.get("val_written"):
        copy_tail(all_bin, val_bin, (n - n_val) * itemsize)
        journal.state["val_written"] = True
        journal.save()
        fault_point("prepare-shard")
    if all_bin.is_file():
        os.truncate(all_bin, (n - n_val) * itemsize)
        os.replace(all_bin, train_bin)
    # the documents of all the tokens (the train split's come first): the train split's documents file
    all_docs = all_bin.with_suffix(DOCS_SUFFIX)
    if all_docs.is_file():
        os.replace(all_docs, train_bin.with_suffix(DOCS_SUFFIX))
    return n - n_val, n_val
