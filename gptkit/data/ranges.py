"""JSON-lines corpora and text files tokenized by byte ranges (text files: see TextFeed below).

JSON lines: each task is a range of a file, from a line start to a line
start (gptkit.data.sources.line_ranges: the main process finds each end with a seek and a short read), and
whoever runs it (a tokenization worker; the main process with data.workers=1, and for byte and char, which
encode in the main process) reads the range, decodes it, parses its lines, cuts each record with the
tokenizer's Cutter and encodes the pieces. A record is a whole document, so nothing crosses a range's ends:
the ids are those of reading the file line by line, for any worker count.

The main process only finds the ranges, takes the results in order (RangeChecks raises what spans lines:
no text field in the first records, none in the file...), checksums and writes them.
"""

from __future__ import annotations

import os
import re
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
from tokenizers import Tokenizer

from gptkit.data import tokenize
from gptkit.data.files import (
    READ_BYTES,
    LineRange,
    RangeChecks,
    RangeStats,
    _bad_byte,
    _empty,
    read_range,
    text_parts,
)
from gptkit.data.tokenize import (
    NO_ENDS,
    Cutter,
    EncoderSpec,
    batches,
    encode_batch,
    text_encoder,
)
from gptkit.data.workers import encode_task, text_bytes
from gptkit.errors import GptkitError

# (range, Cutter mode, Cutter sizes, what the MAX_UNCUT error calls the corpus)
RangeTask = tuple[LineRange, str, dict[str, int], str]

# in a worker: HF encode for Cutter mode verify
_verify: dict[EncoderSpec, Callable[[str], list[int]]] = {}


def _verify_encode(spec: EncoderSpec) -> Callable[[str], list[int]]:
    """The tokenizer's own encode (HF tokenizers, special tokens' strings as the spec encodes them), which
    mode verify checks every cut with."""
    enc = _verify.get(spec)
    if enc is None:
        tok = text_encoder(Tokenizer.from_str(spec.json()), spec.allow_special_text)
        _verify.clear()
        enc = _verify[spec] = lambda t: tok.encode(t, add_special_tokens=False).ids
    return enc


def encode_range(encode: Callable[[list[str]], list[Any]], spec: EncoderSpec, task: RangeTask):
    """One range -> (ids, the ends of the documents it ends (encode_batch), bytes of the file, the range,
    RangeStats (its records' byte offsets: where each document starts in the file), forced cuts): its records
    cut as Cutter.pieces cuts them in the main process, encoded as encode_batch does (BOS and EOS included).
    A range with a bad line is not encoded: the main process raises its error in order."""
    r, mode, sizes, what = task
    texts, stats = read_range(r)
    n_bytes = r.end - r.start
    if stats.error is not None or not texts:
        return np.zeros(0, dtype=spec.dtype), NO_ENDS, n_bytes, r, stats, 0
    cutter = Cutter(mode, spec.specials, _verify_encode(spec) if mode == "verify" else None, sizes)
    # (piece, ends a document, starts a document), as batches()
    batch: list[tuple[str, bool, bool]] = []
    fresh = True
    for piece, ends in cutter.pieces(((t, True) for t in texts), spec.eos, what):
        batch.append((piece, ends, fresh))
        fresh = ends
    ids, ends = encode_batch(encode, batch, spec.eos, spec.dtype, spec.bos)
    return ids, ends, n_bytes, r, stats, cutter.forced


class RangeFeed:
    """The tasks of one split of a JSON-lines corpus for write_tokens: its ranges (of about BATCH_CHARS
    bytes), the function that runs one (encode_range), and the checks of the results, in order."""

    run = staticmethod(encode_range)

    def __init__(self, ranges: Callable[[int], Iterator[LineRange]], cutter: Cutter, what: str) -> None:
        self.ranges, self.mode, self.sizes, self.what = ranges, cutter.mode, cutter.sizes(), what
        self.checks = RangeChecks()
        # Cutter mode gpt2: cuts inside a pre-token longer than HARD_CHARS
        self.forced = 0

    def tasks(self) -> Iterator[RangeTask]:
        return ((r, self.mode, self.sizes, self.what) for r in self.ranges(tokenize.BATCH_CHARS))

    def skipped(self, task: RangeTask) -> int:
        """A range a killed build already wrote: its bytes, for the progress. It is read again (not encoded)
        only while its file's checks could still fail (the first range or two of a file)."""
        r = task[0]
        if not self.checks.settled(r):
            self.checks.add(r, read_range(r)[1])
        return r.end - r.start

    def done(self, result: tuple[Any, Any, int, LineRange, RangeStats, int]) -> None:
        """Check one result (in order); raises the error the line-by-line reader would raise there."""
        _, _, _, r, stats, forced = result
        self.checks.add(r, stats)
        self.forced += forced

    def documents(self, result: tuple) -> list[tuple[str, int]]:
        """(file, byte offset of its record) of each document the result ends: one per record with a text."""
        r, stats = result[3], result[4]
        return [(r.path, at) for at in stats.offsets]


# ---- text files in byte ranges ----------------------------------------------------------------------
# A text file is ONE document, so a range may end only where the Cutter itself may cut (a safe cut: the ids of
# the pieces are the ids of the whole text). The main process finds such places with short reads around
# each nominal end (text_cuts). A file is cut into ranges only when no stretch of HARD_CHARS / 2 bytes of it
# lacks such a place: then neither this path nor the Cutter of the main process (as before) ever makes a
# forced cut, every cut of either is safe, and the ids are the same wherever the cuts fall. Any other file
# (a file of NUL bytes, 300k letters in a row, whitespace only, no line breaks between non-spaces for that
# long...) is read, decoded and cut in the main process as before (it is rare, and its forced cuts fall
# where they fell). Cutter mode verify (any other tokenizer.json) is not cut in ranges: its checks encode.

# a byte that is not UTF-8, decoded with surrogateescape
_SURROGATE = re.compile("[\udc80-\udcff]")
# bytes of the first read around a nominal range end (doubling up to READ_BYTES)
SCAN_BLOCK = 4 << 10


@dataclass(frozen=True)
class TextRange:
    """Bytes [start, end) of a text file: start and end are 0, the file's size, or safe cuts."""

    path: str
    start: int
    end: int
    # of the whole file: start == 0 begins the document, end == size ends it
    size: int
    # data.encoding_errors
    errors: str
    # a file of only whitespace: error | skip
    blank: str


# (the ranges, Cutter mode, Cutter sizes, what the corpus is called) or a batch of pieces cut here
TextTask = tuple[tuple[TextRange, ...], str, dict[str, int], str]


def _margin(cutter: Cutter) -> int:
    """Characters either side of a cut that decide it: its neighbours, and any special token across it."""
    return max([2, *(len(s) + 1 for s in cutter.specials)])


def _first_cut(fh: Any, pos: int, limit: int, size: int, cutter: Cutter) -> int | None:
    """The byte offset of a place in [pos, limit) where `cutter` cuts the text safely (the first candidate of
    Cutter._candidates clear of special tokens), judged on short decoded reads (SCAN_BLOCK, doubling) with
    `_margin` characters of context either side, none of them a byte that is not UTF-8 (errors=replace may
    make one U+FFFD of several); None: none found before limit."""
    margin = _margin(cutter)
    block = SCAN_BLOCK
    while pos < limit:
        a = max(0, pos - 4 * margin)
        fh.seek(a)
        data = fh.read(min(size, pos + block + 4 * margin) - a)
        i = 0
        # to a character's first byte
        while i < min(4, len(data)) and 0x80 <= data[i] < 0xC0:
            i += 1
        # a bad byte: one lone surrogate
        text = data[i:].decode("utf-8", errors="surrogateescape")
        # pos, in characters
        lo = len(data[i : max(i, pos - a)].decode("utf-8", errors="surrogateescape"))
        hi = len(text) - margin
        # newlines first, as Cutter.cut
        for c in cutter._candidates(text, max(lo, margin), hi, None):
            if cutter._clear(text, c) and not _SURROGATE.search(text, c - margin, c + margin):
                at = a + i + len(text[:c].encode("utf-8", errors="surrogateescape"))
                return at if pos <= at < limit else None
        if len(text) < 2 * margin + 1 or a + len(data) >= size:
            # the end of the file
            return None
        pos = max(pos + 1, a + i + len(text[:hi].encode("utf-8", errors="surrogateescape")))
        block = min(2 * block, READ_BYTES)
    return None


def text_cuts(path: str, size: int, step: int, cutter: Cutter) -> list[int] | None:
    """The ends of one text file's ranges (of about `step` bytes) but the last: each a safe cut. None when
    some stretch of hard_chars // 2 bytes holds no safe cut (the file is read as before). A file of at most
    `step` bytes is one range (what the main process made of it as before: one part)."""
    if size <= step:
        return []
    gap = cutter.hard_chars // 2
    cuts: list[int] = []
    # the last safe cut found, the start of the current range
    last = start = 0
    with open(path, "rb") as fh:
        while size - last > gap:
            x, nominal = last + gap // 2, start + step
            if last < nominal <= x:
                x = nominal
            q = _first_cut(fh, x, min(size, last + gap), size, cutter)
            if q is None:
                return None
            if q >= nominal:
                cuts.append(q)
                start = q
            last = q
        if start + step < size:
            q = _first_cut(fh, start + step, size, size, cutter)
            if q is not None:
                cuts.append(q)
    return cuts


def encode_text_ranges(encode: Callable[[list[str]], list[Any]], spec: EncoderSpec, task: TextTask):
    """Text ranges -> (ids, the ends of the documents they end (encode_batch), bytes of the files, error or
    None, forced cuts, the file of each document ended): each read, decoded and cut with Cutter.pieces as one
    part, encoded as encode_batch does: a BOS before the first piece of the range at offset 0, an EOS (or the
    newline separator) after the last of the range at the file's end. The first bad byte (a GptkitError naming
    its file offset) ends the task; raised in order by TextFeed."""
    ranges, mode, sizes, what = task
    cutter = Cutter(mode, spec.specials, None, sizes)
    out, ends, files, n, n_bytes = [], [], [], 0, 0
    for r in ranges:
        n_bytes += r.end - r.start
        with open(r.path, "rb") as fh:
            fh.seek(r.start)
            data = fh.read(r.end - r.start)
        try:
            text = data.decode("utf-8", errors=r.errors)
        except UnicodeDecodeError as exc:
            return (
                np.zeros(0, dtype=spec.dtype),
                NO_ENDS,
                n_bytes,
                _bad_byte(Path(r.path), r.start + exc.start, data[exc.start : exc.start + 1]),
                0,
                [],
            )
        first, last = r.start == 0, r.end == r.size
        # a file of only whitespace is no document
        if first and last and not text.strip():
            if r.blank == "error":
                error = (
                    _empty(r.path)
                    if not r.size
                    else GptkitError(
                        f"{r.path} holds only whitespace; remove it from data.paths or give it some text"
                    )
                )
                return np.zeros(0, dtype=spec.dtype), NO_ENDS, n_bytes, error, 0, []
            continue
        # only the document's end gets the separator (pieces adds it when eos is None) and the EOS
        pieces = list(cutter.pieces(iter([(text, True)]), spec.eos if last else 0, what))
        batch = [(p, last and k == len(pieces) - 1, first and k == 0) for k, (p, _) in enumerate(pieces)]
        ids, ended = encode_batch(encode, batch, spec.eos, spec.dtype, spec.bos)
        out.append(ids)
        ends.append(ended + n)
        files += [r.path] * len(ended)
        n += len(ids)
    ids = np.concatenate(out) if out else np.zeros(0, dtype=spec.dtype)
    return ids, (np.concatenate(ends) if ends else NO_ENDS), n_bytes, None, cutter.forced, files


def run_text_task(encode: Callable[[list[str]], list[Any]], spec: EncoderSpec, task: Any):
    """A TextFeed task: text ranges (encode_text_ranges), a batch of pieces the main process cut (a file
    read as before: encode_task; the file of its documents is the feed's to tell), or the error that reading
    such a file raised."""
    if isinstance(task, list):
        return (*encode_task(encode, spec, task), None, 0, None)
    # the error of a file read here (TextFeed.tasks), in its place
    if isinstance(task, GptkitError):
        return np.zeros(0, dtype=spec.dtype), NO_ENDS, 0, task, 0, []
    return encode_text_ranges(encode, spec, task)


class TextFeed:
    """The tasks of one split of text files for write_tokens: byte ranges of about BATCH_CHARS bytes (small
    files grouped into one task), whose ends text_cuts found; a file that cannot be cut so is read, decoded
    and cut here as before, in batches of pieces."""

    run = staticmethod(run_text_task)

    def __init__(
        self, files: list[Path], errors: str, blank: str, cutter: Cutter, eos: int | None, what: str
    ) -> None:
        self.files, self.errors, self.blank, self.cutter, self.eos, self.what = (
            files,
            errors,
            blank,
            cutter,
            eos,
            what,
        )
        # counted by whoever ran a range (here, the main process's Cutter counts its own)
        self.forced = 0
        # files read and cut in this process (no safe cut in some stretch)
        self.read_here = 0
        # per task given out and not yet done, in order: the file of a batch of pieces cut here (its result
        # does not say it), None for the others (whose results do)
        self._files: deque[str | None] = deque()

    def tasks(self) -> Iterator[Any]:
        step, mode, sizes = tokenize.BATCH_CHARS, self.cutter.mode, self.cutter.sizes()
        group: list[TextRange] = []
        n = 0
        for f in self.files:
            size = os.stat(f).st_size
            cuts = text_cuts(str(f), size, step, self.cutter)
            if cuts is None:
                if group:
                    self._files.append(None)
                    yield tuple(group), mode, sizes, self.what
                    group, n = [], 0
                self.read_here += 1
                try:
                    for batch in batches(
                        self.cutter.pieces(text_parts(f, self.errors, self.blank), self.eos, self.what)
                    ):
                        self._files.append(str(f))
                        yield batch
                # raised in order: ranges before it may hold an earlier error
                except GptkitError as exc:
                    self._files.append(None)
                    yield exc
                    return
                continue
            for s, e in zip([0, *cuts], [*cuts, size]):
                group.append(TextRange(str(f), s, e, size, self.errors, self.blank))
                n += e - s
                if n >= step:
                    self._files.append(None)
                    yield tuple(group), mode, sizes, self.what
                    group, n = [], 0
        if group:
            self._files.append(None)
            yield tuple(group), mode, sizes, self.what

    def skipped(self, task: Any) -> int:
        """A task a killed build already wrote: its bytes, for the progress."""
        self._files.popleft()
        if isinstance(task, GptkitError):
            return 0
        return text_bytes(task) if isinstance(task, list) else sum(r.end - r.start for r in task[0])

    def documents(self, result: tuple) -> list[tuple[str, int]]:
        """(file, byte offset 0) of each document a task's result ends: a text file is one document."""
        cut_here = self._files.popleft()
        files = result[5] if result[5] is not None else [cut_here] * len(result[1])
        return [(f, 0) for f in files]

    def done(self, result: tuple) -> None:
        """Raise a task's error (in order: the first bad byte of the corpus, a file of only whitespace)."""
        if result[3] is not None:
            raise result[3]
        self.forced += result[4]
