"""Writing token shards: each split's ids appended in input order, committed every SHARD_TOKENS tokens.

A build's `progress.json` (the Journal) records, for each split, how much of its shard is complete (its
length, CRC-32 and how many tasks of the input it holds), synced at every commit. A build killed at any
moment is continued: the shard is cut back to its last complete length (resume_shard checks that prefix
against its CRC-32), the tasks it holds are skipped, and the rest is written as before, so the result is
bit-identical to an uninterrupted build (gptkit/data/build.py says how a build is found and finished).
"""

from __future__ import annotations

import json
import os
import zlib
from pathlib import Path
from typing import Any, Iterator

from gptkit.data.console import Progress
from gptkit.data.prepared import DTYPES, copy_tail
from gptkit.data.tokenize import Tokenizing, encode_task, text_bytes
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


class BatchFeed:
    """The tasks of one split of any corpus for write_tokens: batches of pieces that this process reads and
    cuts, which the workers encode (encode_task). (JSON-lines corpora: gptkit.data.ranges.RangeFeed.)"""

    run = staticmethod(encode_task)
    # counted by the Cutter of this process
    forced = 0

    def __init__(self, work: Iterator[list[tuple[str, bool, bool]]]) -> None:
        self.work = work

    def tasks(self) -> Iterator[list[tuple[str, bool, bool]]]:
        return self.work

    def skipped(self, batch: list[tuple[str, bool, bool]]) -> int:
        """A batch a killed build already wrote: its bytes, for the progress."""
        return text_bytes(batch)

    def done(self, result: tuple) -> None:
        """Nothing to check: the reading and cutting here raised any error already."""


def write_tokens(
    tokenizing: Tokenizing,
    feed: Any,
    out: Path,
    journal: Journal,
    split: str,
    progress: Progress,
) -> tuple[int, int]:
    """Tokenize the feed's tasks into `out` (appended raw ids), committing every SHARD_TOKENS tokens and
    skipping the tasks a killed build already committed. Returns (tokens, documents) of the split."""
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
    with open(out, "ab") as f:
        for result in tokenizing.map(todo(), feed.run):
            feed.done(result)
            arr, docs, n_bytes = result[:3]
            data = arr.tobytes()
            f.write(data)
            sp["crc32"] = zlib.crc32(data, sp["crc32"])
            sp["bytes"] += len(data)
            sp["tokens"] += len(arr)
            sp["documents"] += docs
            sp["batches"] += 1
            since += len(arr)
            progress.advance(n_bytes, len(arr))
            fault_point("prepare-batch")
            if since >= SHARD_TOKENS:
                commit(f, journal)
                since = 0
        sp["done"] = True
        commit(f, journal)
    return sp["tokens"], sp["documents"]


def commit(f, journal: Journal) -> None:
    f.flush()
    os.fsync(f.fileno())
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
    return n - n_val, n_val
